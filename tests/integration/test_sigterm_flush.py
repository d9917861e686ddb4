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
