"""Step phase timing: host clocks on CPU, CUDA events on GPU (host clocks lie under async launch)."""

from __future__ import annotations

import time
from typing import Any


class HostPhaseClock:
    """Marks are perf_counter readings; durations are known at once."""

    def mark(self) -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed(a: Any, b: Any) -> float | None:
        return b - a

    def ready(self, mark: Any) -> bool:
        return True

    def sync(self) -> None:
        """Nothing is in flight on the host clock."""


class CudaPhaseClock:
    """Marks are recorded CUDA events; a duration is read only once its end event completed,
    so timing never adds a device synchronization to the step. Events come from a pool and
    go back to it once their step's durations are read (`device_events`)."""

    def __init__(self, device: Any) -> None:
        import torch

        from trainspec.device_events import recorder

        self._torch = torch
        self.device = device
        as_device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        self._index = as_device.index  # None: the current device, at each mark
        self._events = recorder()

    def _device_index(self) -> int:
        index = self._index
        return self._torch.cuda.current_device() if index is None else index

    def mark(self) -> Any:
        return self._events.record(self._device_index(), timing=True)

    @staticmethod
    def elapsed(a: Any, b: Any) -> float | None:
        return a.elapsed_time(b) / 1000.0

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def release(self, marks: list[Any]) -> None:
        """Marks whose durations are read: recorded again by later steps."""
        self._events.give_back(marks, timing=True)

    def sync(self) -> None:
        """Wait for the device (at shutdown only), so the last steps' events can be read."""
        self._torch.cuda.synchronize(self.device)


PHASES = ("forward", "backward", "optimizer")


class StepTiming:
    """Phase marks of one step; turned into seconds once the clock says they are ready.

    A phase entered several times in one step (a forward and a backward per micro-batch under
    gradient accumulation) counts the sum of its intervals.
    """

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.marks: dict[str, list[tuple[Any, Any]]] = {}
        self._open: dict[str, Any] = {}
        self._seconds: dict[str, float | None] | None = None  # once read (marks given back)

    def begin(self, phase: str, *, at: Any = None) -> None:
        """Open `phase` now, or at an earlier mark `at` of this clock."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        self._open[phase] = self.clock.mark() if at is None else at

    def take(self, other: StepTiming) -> bool:
        """Take the marks and open phases of `other`, timed on the same kind of clock before
        this step's record existed (the zero-code layer's step 0 before its session
        started), in place of this one's; False, and nothing taken, on another clock."""
        if type(other.clock) is not type(self.clock) or self._seconds is not None:
            return False
        self.marks = {phase: list(pairs) for phase, pairs in other.marks.items()}
        self._open = dict(other._open)
        return True

    def discard(self, phase: str) -> None:
        """Forget an open `phase` without counting it (a tentative start that no end came for)."""
        self._open.pop(phase, None)

    def is_open(self, phase: str) -> bool:
        return phase in self._open

    def touched(self) -> bool:
        """Whether any phase was begun (only PHASES can be)."""
        return bool(self.marks) or bool(self._open)

    def end(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            self.marks.setdefault(phase, []).append((start, self.clock.mark()))

    def ready(self) -> bool:
        return all(self.clock.ready(pairs[-1][1]) for pairs in self.marks.values())

    def seconds(self) -> dict[str, float | None]:
        """Phase durations; a phase whose marks cannot be read (device lost) is None. The
        first call reads the marks and gives them back to the clock for reuse; later calls
        return what it read."""
        if self._seconds is not None:
            return dict(self._seconds)
        out: dict[str, float | None] = {}
        for phase, pairs in self.marks.items():
            try:
                out[phase] = sum(self.clock.elapsed(a, b) for a, b in pairs)
            except (RuntimeError, TypeError):  # TypeError: a None from a lost mark
                out[phase] = None
        self._seconds = dict(out)
        release = getattr(self.clock, "release", None)
        if release is not None:
            release(
                [
                    m
                    for pairs in self.marks.values()
                    for pair in pairs
                    for m in pair
                    if m is not None
                ]
            )
        return out
