"""Step phase timing: a phase entered once per micro-batch counts the sum of its intervals."""

from __future__ import annotations

import pytest

from trainspec.runtime.step_timer import StepTiming


class TickClock:
    """A host clock that advances one second per mark."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        self.now += 1.0
        return self.now

    @staticmethod
    def elapsed(a: float, b: float) -> float:
        return b - a

    def ready(self, mark: float) -> bool:
        return True


def test_repeated_phases_are_summed_not_overwritten():
    timing = StepTiming(TickClock())
    for _ in range(3):  # three micro-batches: forward, backward each
        timing.begin("forward")
        timing.end("forward")
        timing.begin("backward")
        timing.end("backward")
    timing.begin("optimizer")
    timing.end("optimizer")
    assert timing.seconds() == {"forward": 3.0, "backward": 3.0, "optimizer": 1.0}
    assert timing.ready()


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase"):
        StepTiming(TickClock()).begin("warmup")
