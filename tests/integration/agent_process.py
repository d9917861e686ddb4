"""`trainspec-agent` as a real subprocess on loopback, ready when /readyz says so."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def start_agent(
    store: Path,
    port: int,
    *extra: str,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """The agent on `port`, with `env` added to this process's environment."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainspec.agent.main", "--listen", f"127.0.0.1:{port}",
         "--store", str(store), *extra],
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"trainspec-agent exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("trainspec-agent did not become ready")


def stop_agent(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
