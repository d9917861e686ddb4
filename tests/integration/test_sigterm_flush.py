"""SIGTERM (a preemption notice, torchrun stopping the group) flushes what was measured."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

import trainspec.store as store

SCRIPT = Path(__file__).parent / "scripts" / "sigterm_steps.py"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sigterm_flushes_every_step_recorded_before_it(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    last = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        last = int(line.split()[1])
        if last >= 30:  # well inside the 2 s flush interval: only the signal path can save them
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert proc.returncode == -signal.SIGTERM
    stored = store.open(tmp_path / "sigterm").execute("SELECT max(step) FROM steps").fetchone()[0]
    assert stored >= last


REENTERED = """
import os, signal, sys, time
import trainspec

signal.signal(signal.SIGTERM, lambda s, f: print("handed over", flush=True))
ts = trainspec.init(run_root=sys.argv[1], run_id="reentered")
with ts.step(samples=1):
    pass
with ts.collector._journal_lock:  # the main thread inside a flush, as ts.flush() would be
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # the handler runs here, between two bytecodes, holding the lock
print("went on", flush=True)
ts.close()
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_sigterm_during_a_flush_on_the_main_thread_does_not_hang(tmp_path):
    """The handler flushed on the main thread, re-entering the locks the interrupted flush
    held: the process hung for good."""
    proc = subprocess.run(
        [sys.executable, "-c", REENTERED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["handed", "over", "went", "on"]
    stored = store.open(tmp_path / "reentered").execute("SELECT count(*) FROM steps").fetchone()
    assert stored == (1,)
