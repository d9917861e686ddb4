"""Gradient statistics in one process, across gradient-accumulation micro-steps.

Each micro-step's gradient plays the part a rank's plays under DDP, so a single-process
job with accumulation gets the same variance and noise scale (McCandlish et al. 2018,
appendix A; the estimator is `trainspec.kernels.MicroStepStats`). Costs one copy of the
gradients, so it is on only when the job says its micro-batch size.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from trainspec.host_copy import HostValues
from trainspec.kernels import GradientStats, MicroStepStats
from trainspec.kernels.late_stats import LateFigures
from trainspec.runtime import loss_scale

# Taken steps whose statistics nobody read yet, past which the oldest is read at once (its
# copy long landed): a source whose summaries are never asked for stays bounded.
_MAX_UNREAD = 8


class MicroStepGradients:
    """A `GradientStatsSource`: observe after each backward, summarise before the update.
    The step's squares travel to the host without a device synchronization (`host_copy`);
    statistics are computed when a step's record is made. Every taken step is computed, in
    the order taken, also one no record asks for (two updates in one recorded step, a step
    that failed after its update), so the noise-scale EMA moves as it did when each was
    read at once."""

    def __init__(self, parameters: Any, micro_batch_size: int) -> None:
        self._params = [p for p in parameters if p.requires_grad]
        self._stats = MicroStepStats(micro_batch_size)
        self._observed = 0
        self._latest: _DeferredMicroStats | None = None
        self._unread: deque[_DeferredMicroStats] = deque()

    def after_backward(self) -> None:
        self._stats.observe(self._params)
        self._observed += 1

    def before_update(self) -> None:
        if self._observed:
            squares = HostValues(*self._stats.take_step())
            self._latest = _DeferredMicroStats(self, squares, loss_scale.current())
            self._unread.append(self._latest)
            self._observed = 0
            if len(self._unread) > _MAX_UNREAD:
                self.compute_through(self._unread[0])

    def step_summary(self) -> _DeferredMicroStats | None:
        latest, self._latest = self._latest, None
        return latest

    def compute_through(self, target: _DeferredMicroStats) -> None:
        """Compute every unread step up to `target`, in the order they were taken."""
        while self._unread and target.stats is None:
            step = self._unread.popleft()
            per_device = _split(step.squares.floats(), step.squares.parts)
            step.stats = self._stats.stats_of(
                MicroStepStats.combine(per_device), loss_scale.value(step.scale)
            )


def _split(values: list[float], parts: int) -> list[list[float]]:
    size = len(values) // parts
    return [values[k * size : (k + 1) * size] for k in range(parts)]


class _DeferredMicroStats(LateFigures):
    """One step's `GradientStats`, computed on first read (with every step before it)."""

    def __init__(self, owner: MicroStepGradients, squares: HostValues, scale: Any) -> None:
        self._owner = owner
        self.squares = squares  # one [|delta_1|^2 .. |delta_K|^2, |total|^2] per device
        self.scale = scale  # the GradScaler's scale (loss_scale.current()), read with them
        self.stats: GradientStats | None = None

    def ready(self) -> bool:
        return self.squares.ready()

    def resolved(self) -> GradientStats:
        self._owner.compute_through(self)
        assert self.stats is not None
        return self.stats

    def figure(self, name: str) -> Any:
        return getattr(self.resolved(), name)
