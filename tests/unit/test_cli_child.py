"""`trainspec run` passes SIGTERM on to the job it launched (it left torchrun and its ranks
training as orphans) and reports a job killed by signal N as 128 + N (it said 247 for 9)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from trainspec.cli.main import main

pytestmark = pytest.mark.timeout(60)

JOB = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write(str(signum))
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(30)
"""


def test_a_job_killed_by_a_signal_exits_128_plus_its_number(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path), "--", "bash", "-c", "kill -9 $$"]) == 137
    assert main(["run", "--out", str(tmp_path), "--", "bash", "-c", "exit 3"]) == 3


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_trainspec_run_reaches_the_job_and_its_status_comes_back(tmp_path, signum):
    """SIGTERM as Kubernetes sends it to PID 1; SIGINT from a tool, not the terminal (it was
    ignored, on the assumption that a Ctrl-C reaches the whole foreground group, and the job
    kept training)."""
    marker = tmp_path / "got"
    job = tmp_path / "job.py"
    job.write_text(JOB)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainspec.cli.main", "run", "--out", str(tmp_path / "runs"),
         "--", sys.executable, str(job), str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True,  # no terminal: a signal from a tool
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "got.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)  # to trainspec run alone
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()  # the job, if it was left running, ends with its 30 s sleep
    assert marker.read_text() == str(int(signum)), err
    assert proc.returncode == 7, err  # the job's status, not KeyboardInterrupt's 130
    assert "the job exited with code 7" in err.splitlines()[-1], err


def test_trainspec_run_from_a_thread_runs_and_waits_for_the_job(tmp_path):
    """Off the main thread Python allows no signal handlers: the handler set-up raised after
    the job had started, and the job was left running, never waited for."""
    import threading

    result: list[int] = []
    argv = ["run", "--out", str(tmp_path), "--", "bash", "-c", "sleep 0.2; exit 5"]
    worker = threading.Thread(target=lambda: result.append(main(argv)))
    worker.start()
    worker.join(30)
    assert result == [5]
