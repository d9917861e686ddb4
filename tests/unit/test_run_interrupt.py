"""`trainspec run` passes a signal on to its job even when it comes while the job is being
started, and does not pass on the terminal's Ctrl-C, which the job got itself (SIGINT and
SIGTERM from a tool: test_cli_child.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from trainspec.cli.child import forwarding_signals

pytestmark = pytest.mark.timeout(60)


def test_a_signal_before_the_job_has_started_reaches_it_once_started():
    """The handler ran while the job was being started: with no job to pass it to yet, the
    signal was dropped and the job ran on."""

    def start() -> subprocess.Popen:
        signal.raise_signal(signal.SIGTERM)  # comes in while the job is being started
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    with forwarding_signals(start) as proc:
        try:
            assert proc.wait(timeout=20) == -signal.SIGTERM
        finally:
            proc.kill()


# Run under a pseudo-terminal (pty.fork: a new session whose controlling terminal it is, in
# its foreground group): a job in that group got the terminal's Ctrl-C; one in a session of
# its own (as torchrun starts its workers) did not.
TERMINAL = """
import os, pty, subprocess, sys
from trainspec.cli.child import _job_got_the_terminal_s
pid, fd = pty.fork()
if pid == 0:
    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    apart = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"],
                             start_new_session=True)
    seen = (_job_got_the_terminal_s(same.pid), _job_got_the_terminal_s(apart.pid))
    same.kill(); apart.kill(); same.wait(); apart.wait()
    print(f"verdict {seen}", flush=True)
    os._exit(0)
out = b""
while True:
    try:
        chunk = os.read(fd, 1024)
    except OSError:  # EIO: the child closed the terminal
        break
    if not chunk:
        break
    out += chunk
os.waitpid(pid, 0)
print(out.decode(errors="replace"))
"""


def test_the_terminal_s_ctrl_c_is_not_passed_on_to_a_job_that_got_it():
    proc = subprocess.run(
        [sys.executable, "-c", TERMINAL], capture_output=True, text=True, timeout=40
    )
    assert "verdict (True, False)" in proc.stdout, proc.stdout + proc.stderr
    from trainspec.cli.child import _job_got_the_terminal_s

    assert _job_got_the_terminal_s(2**22 + 12345) is False  # no such process (any more)
