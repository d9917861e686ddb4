"""The event pool behind phase marks and host copies (device_events), and its owners'
hand-back: a mark is reused only after its one reader is done with it."""

from __future__ import annotations

from typing import Any

import pytest

from trainspec.device_events import FreeList
from trainspec.runtime.step_timer import StepTiming


def test_a_given_back_event_is_taken_again_before_a_new_one_is_made() -> None:
    made: list[object] = []

    def factory() -> object:
        made.append(object())
        return made[-1]

    pool = FreeList(factory)
    first, second = pool.take(), pool.take()
    assert made == [first, second]
    pool.give_back([first])
    assert pool.take() is first
    assert len(made) == 2
    assert pool.take() is not second  # second was never given back: a new one
    assert len(made) == 3


def test_the_pool_keeps_no_more_than_its_limit() -> None:
    pool = FreeList(object, limit=3)
    pool.give_back([object() for _ in range(10)])
    assert len(pool) == 3


class ReleasingClock:
    """A host clock whose marks are numbered objects and whose releases are recorded."""

    def __init__(self) -> None:
        self.now = 0
        self.released: list[Any] = []

    def mark(self) -> int:
        self.now += 1
        return self.now

    @staticmethod
    def elapsed(a: int, b: int) -> float:
        return float(b - a)

    def ready(self, mark: int) -> bool:
        return True

    def release(self, marks: list[Any]) -> None:
        self.released.extend(marks)


def test_timing_gives_its_marks_back_once_read_and_reads_them_once() -> None:
    clock = ReleasingClock()
    timing = StepTiming(clock)
    for phase in ("forward", "backward"):
        timing.begin(phase)
        timing.end(phase)
    assert clock.released == []  # nothing goes back before the durations are read
    first = timing.seconds()
    assert first == {"forward": 1.0, "backward": 1.0}
    assert sorted(clock.released) == [1, 2, 3, 4]
    # A second read must not read the marks again: the pool may have recorded them since.
    clock.elapsed = lambda a, b: 99.0  # type: ignore[method-assign]
    assert timing.seconds() == first
    assert sorted(clock.released) == [1, 2, 3, 4]


def test_a_clock_without_release_still_reads() -> None:
    class Plain(ReleasingClock):
        release = None  # type: ignore[assignment]

    timing = StepTiming(Plain())
    timing.begin("optimizer")
    timing.end("optimizer")
    assert timing.seconds() == {"optimizer": 1.0}


def test_events_go_back_to_the_pool_of_the_device_they_were_made_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch records an event only on its own device's streams: an event of cuda:1 given
    back into cuda:0's pool would fail the next mark there (a step's phase, not telemetry)."""
    import torch

    from trainspec.device_events import EventRecorder

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.enable_timing = enable_timing

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    events = EventRecorder()
    zero, one = events._pool(0, True).take(), events._pool(1, True).take()
    stranger = FakeEvent(enable_timing=True)  # not made here: dropped, not pooled
    events.give_back([one, stranger, zero], timing=True)
    assert events._pool(0, True).take() is zero
    assert events._pool(1, True).take() is one
    assert events._pool(1, True).take() is not stranger
    assert len(events._pool(0, False)) == 0  # plain events are pooled apart
