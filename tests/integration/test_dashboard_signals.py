"""`trainspec dashboard` passes a stop on to Streamlit: a `kill` of the command alone left
its Streamlit child serving the port (found 2026-11-25)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.integration.jobs import free_port

pytestmark = pytest.mark.integration


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_dashboard_command_stops_streamlit(tmp_path, signum):
    pytest.importorskip("streamlit")
    (tmp_path / "runs").mkdir()
    port = free_port()
    cmd = [
        sys.executable, "-c", "import sys; from trainspec.cli.main import main; sys.exit(main())",
        "dashboard", str(tmp_path / "runs"), "--server.port", str(port),
        "--server.headless", "true", "--server.fileWatcherType", "none",
    ]  # fmt: skip
    log = (tmp_path / "dashboard.log").open("w")
    # A session of its own, with no terminal: the signal below reaches the command alone.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(url):
            assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "dashboard not healthy after 60 s"
            time.sleep(0.3)
        os.kill(proc.pid, signum)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _answers(url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _answers(url), "Streamlit still serves after the command was stopped"
        assert proc.returncode in (0, 128 + signum), proc.returncode
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
        log.close()
