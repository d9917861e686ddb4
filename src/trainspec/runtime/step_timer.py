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
    so timing never adds a device synchronization to the step."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device

    def mark(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def elapsed(a: Any, b: Any) -> float | None:
        return a.elapsed_time(b) / 1000.0

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

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

    def begin(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        self._open[phase] = self.clock.mark()

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
        """Phase durations; a phase whose marks cannot be read (device lost) is None."""
        out: dict[str, float | None] = {}
        for phase, pairs in self.marks.items():
            try:
                out[phase] = sum(self.clock.elapsed(a, b) for a, b in pairs)
            except (RuntimeError, TypeError):  # TypeError: a None from a lost mark
                out[phase] = None
        return out
