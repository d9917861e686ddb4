"""trainspec off (`collector.enabled` false): a step that nobody's record reads is timed on
the host clock and copies nothing to the host, so off costs a GPU job no events and no
copies; a listener (the actuator's controller) brings the session's own clock back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainspec.runtime.step_timer import HostPhaseClock


class CountingClock(HostPhaseClock):
    def __init__(self) -> None:
        self.marks = 0

    def mark(self) -> float:
        self.marks += 1
        return super().mark()


@pytest.fixture
def off(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    import trainspec
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_ENABLED", "0")
    session = trainspec.init(run_root=tmp_path)
    session.clock = CountingClock()
    yield session
    session.close()


def _step(session: Any, loss: torch.Tensor) -> None:
    with session.step(samples=2) as s:
        with s.phase("forward"):
            pass
        s.loss = loss


def test_off_a_step_records_no_marks_on_the_sessions_clock_and_copies_no_loss(
    off: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainspec.runtime.session as session_module

    copies: list[Any] = []
    monkeypatch.setattr(session_module, "_loss_values", lambda loss: copies.append(loss))
    assert off.collector is None
    for _ in range(3):
        _step(off, torch.tensor(1.0))
    assert off.clock.marks == 0
    assert copies == []
    assert off.step_index == 3


def test_off_with_a_listener_the_step_is_timed_and_recorded(off: Any) -> None:
    records: list[Any] = []
    off.record_listeners.append(records.append)
    _step(off, torch.tensor(2.5))
    assert off.clock.marks == 2
    assert [(r.step, r.loss) for r in records] == [(0, 2.5)]
    assert records[0].forward_s is not None
