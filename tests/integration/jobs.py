"""Launch the reference workload under a real torchrun, with hard time limits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "src" / "trainspec" / "workload" / "train_gpt.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, attempts: int = 50) -> int:
    """A base port such that base .. base + count - 1 are all free now (one port per rank:
    a lone free port's neighbour may be taken by another job on the machine)."""
    for _ in range(attempts):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def torchrun(
    root: Path,
    run_id: str,
    *,
    ranks: int = 2,
    steps: int = 30,
    env: dict[str, str] | None = None,
    script_args: list[str] | None = None,
    script: Path = SCRIPT,
    timeout_s: float = 240.0,
    launcher: list[str] | None = None,
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(
        TRAINSPEC_STORE_ROOT=str(root),
        TRAINSPEC_STORE_RUN_ID=run_id,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    full_env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    full_env.update(env or {})
    cmd = [
        *(launcher or []),
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(script), *(script_args if script_args is not None else [f"--steps={steps}", "--batch-size=8"]),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc
