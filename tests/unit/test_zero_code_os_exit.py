"""The zero-code layer at `os._exit` (`auto_exit_hooks._os_exit_watched`): no atexit handler
runs after it, so the session was never closed: the steps since its last flush were lost,
and a failing code left no failure on record. Now the process whose session it is records
the exit and closes the session, waiting a bounded time, and exits with the same code."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import trainspec.store as store
from tests.unit.test_zero_code_failure import train
from trainspec.runtime.auto import AutoInstrumentation, _os_exit_watched


class RealExit:
    """Stands in for the real `os._exit`: the codes it was called with."""

    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def on_disk(auto: AutoInstrumentation) -> tuple[list[int], list[tuple]]:
    """The steps and events in the run store now (nothing flushed here: what the layer's
    close stored, or nothing)."""
    run = auto.session.run_dir
    steps = store.query(run, "SELECT step FROM steps ORDER BY step").to_pylist()
    sql = "SELECT step, kind, name, severity, reason FROM events ORDER BY ts"
    return [r["step"] for r in steps], [
        tuple(r.values()) for r in store.query(run, sql).to_pylist()
    ]


@pytest.fixture
def owned(auto: AutoInstrumentation) -> AutoInstrumentation:
    """`auto`, its session started by this process (as `start` records it)."""
    auto.session_pid = os.getpid()
    return auto


def test_a_failing_os_exit_fails_the_step_in_progress_and_stores_the_rest(owned):
    """Left after step 3's backward: steps 0-2 are stored by the close, step 3 failed."""
    for _ in range(3):
        train(owned)
    train(owned, step=False)
    real = RealExit()
    _os_exit_watched(owned, real)(3)
    assert real.codes == [3]
    assert owned.session.closed
    assert on_disk(owned) == (
        [0, 1, 2],
        [(3, "fault", "step_failed", "warning", "HardExit: os._exit(3)")],
    )


def test_os_exit_0_stores_the_last_step_and_records_no_failure(owned):
    for _ in range(4):
        train(owned)
    real = RealExit()
    _os_exit_watched(owned, real)(0)
    assert real.codes == [0] and owned.session.closed
    assert on_disk(owned) == ([0, 1, 2, 3], [])


def test_a_process_forked_from_the_session_s_owner_exits_untouched(owned, monkeypatch):
    """A DataLoader worker, forked with a copy of the session, ends in `os._exit`: its
    exit is none of the job's, and it must not write the parent's session out."""
    train(owned)
    train(owned, step=False)
    monkeypatch.setattr(os, "getpid", lambda: owned.session_pid + 1)
    real = RealExit()
    _os_exit_watched(owned, real)(1)
    assert real.codes == [1]
    assert not owned.session.closed
    assert on_disk(owned) == ([], [])


def test_the_wait_for_the_layer_is_bounded(owned, monkeypatch):
    """A close that hangs (a flush stuck on storage) holds the exit `wait_s`, no longer."""
    release = threading.Event()
    entered = threading.Event()

    def stuck(code: int, timeout_s: float) -> None:
        entered.set()
        release.wait(30)

    monkeypatch.setattr(owned, "on_os_exit", stuck)
    real = RealExit()
    began = time.monotonic()
    _os_exit_watched(owned, real, wait_s=0.3)(7)
    waited = time.monotonic() - began
    release.set()
    assert entered.is_set() and real.codes == [7]
    assert 0.3 <= waited < 2.0, waited


def test_a_failure_of_the_layer_s_own_is_contained(owned, monkeypatch):
    def broken(code: int, timeout_s: float) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(owned, "on_os_exit", broken)
    real = RealExit()
    _os_exit_watched(owned, real)(2)
    assert real.codes == [2] and owned.failures == 1


def test_a_sigterm_during_the_wait_does_not_cut_the_flush_short(owned, monkeypatch):
    """torchrun sends SIGTERM to the other ranks once one has exited: trainspec's handler
    found the session closing and ended the rank in its flush, by that signal."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:

        def closing(code: int, timeout_s: float) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # (as torchrun's, mid-close)
            time.sleep(0.2)

        monkeypatch.setattr(owned, "on_os_exit", closing)
        real = RealExit()
        _os_exit_watched(owned, real)(3)
        assert real.codes == [3] and received == []
        os.kill(os.getpid(), signal.SIGTERM)  # after the wait, the handler is the script's again
        time.sleep(0.05)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
