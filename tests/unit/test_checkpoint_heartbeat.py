"""Heartbeat and PreemptionWatcher on a one-rank gloo group (the two-rank cases are integration)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainspec.runtime.heartbeat import Heartbeat, PreemptionWatcher

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]


def test_no_progress_is_reported_once_and_progress_clears_it() -> None:
    events: list[tuple[str, str, dict]] = []
    hb = Heartbeat(
        interval_s=0.05, timeout_s=5, stall_timeout_s=0.3, on_event=lambda *e: events.append(e)
    )
    hb.start()
    hb.progress(4)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(events) == 1
    kind, cause, evidence = events[0]
    assert (kind, cause, evidence["rank"], evidence["step"]) == ("fault", "no progress", 0, 4)
    assert evidence["idle_s"] >= 0.3
    hb.progress(5)
    time.sleep(0.2)
    assert hb.beats > 3 and hb.faults == [(0, "no progress")]
    hb.stop()


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"timeout_s": -1}, {"stall_timeout_s": 0}])
def test_bad_intervals_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Heartbeat(**kwargs)


def test_sigterm_becomes_an_agreed_stop_and_close_restores_the_handler() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    watcher = PreemptionWatcher(timeout_s=10, grace_s=600)
    try:
        assert watcher.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert watcher.should_stop() is True and watcher.signal_received == signal.SIGTERM
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert watcher._deadline is not None and not watcher._deadline.is_alive()
