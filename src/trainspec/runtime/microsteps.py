"""Gradient statistics in one process, across gradient-accumulation micro-steps.

Each micro-step's gradient plays the part a rank's plays under DDP, so a single-process
job with accumulation gets the same variance and noise scale (McCandlish et al. 2018,
appendix A; the estimator is `trainspec.kernels.MicroStepStats`). Costs one copy of the
gradients, so it is on only when the job says its micro-batch size.
"""

from __future__ import annotations

from typing import Any

from trainspec.collector.host_copy import HostValues
from trainspec.kernels import GradientStats, MicroStepStats
from trainspec.runtime import loss_scale


class MicroStepGradients:
    """A `GradientStatsSource`: observe after each backward, summarise before the update.
    The step's squares travel to the host without a device synchronization (`host_copy`);
    its statistics are computed when its record is made, in step order."""

    def __init__(self, parameters: Any, micro_batch_size: int) -> None:
        self._params = [p for p in parameters if p.requires_grad]
        self._stats = MicroStepStats(micro_batch_size)
        self._observed = 0
        self._latest: _DeferredMicroStats | None = None

    def after_backward(self) -> None:
        self._stats.observe(self._params)
        self._observed += 1

    def before_update(self) -> None:
        if self._observed:
            squares = HostValues(self._stats.take_step())
            self._latest = _DeferredMicroStats(self._stats, squares, loss_scale.current())
            self._observed = 0

    def step_summary(self) -> _DeferredMicroStats | None:
        latest, self._latest = self._latest, None
        return latest


def _field(name: str) -> Any:
    """A read-only field of the step's statistics, computed at its first read."""
    return property(lambda self: getattr(self._resolved(), name))


class _DeferredMicroStats:
    """One step's `GradientStats`, computed on first read (the session reads steps in order,
    once their values reached the host, so the noise-scale EMA moves in step order)."""

    def __init__(self, stats: MicroStepStats, squares: HostValues, scale: Any) -> None:
        self._source = stats
        self._squares = squares
        self._scale = scale  # the GradScaler's scale as a host tensor, read with the squares
        self._stats: GradientStats | None = None

    def ready(self) -> bool:
        return self._squares.ready()

    def _resolved(self) -> GradientStats:
        if self._stats is None:
            self._stats = self._source.stats_of(
                self._squares.floats(), loss_scale.value(self._scale)
            )
        return self._stats

    grad_norm = _field("grad_norm")
    grad_variance = _field("grad_variance")
    grad_noise_scale = _field("grad_noise_scale")
    comm_bytes = _field("comm_bytes")
    allreduce_s = _field("allreduce_s")
    last_bucket_ready = _field("last_bucket_ready")
    compression = _field("compression")
