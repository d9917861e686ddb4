"""Gradient statistics in one process, across gradient-accumulation micro-steps.

Each micro-step's gradient plays the part a rank's plays under DDP, so a single-process
job with accumulation gets the same variance and noise scale (McCandlish et al. 2018,
appendix A; the estimator is `trainspec.kernels.MicroStepStats`). Costs one copy of the
gradients, so it is on only when the job says its micro-batch size.
"""

from __future__ import annotations

from typing import Any

from trainspec.kernels import GradientStats, MicroStepStats
from trainspec.runtime import loss_scale


class MicroStepGradients:
    """A `GradientStatsSource`: observe after each backward, summarise before the update."""

    def __init__(self, parameters: Any, micro_batch_size: int) -> None:
        self._params = [p for p in parameters if p.requires_grad]
        self._stats = MicroStepStats(micro_batch_size)
        self._observed = 0
        self._latest: GradientStats | None = None

    def after_backward(self) -> None:
        self._stats.observe(self._params)
        self._observed += 1

    def before_update(self) -> None:
        if self._observed:
            self._latest = self._stats.finish_step(loss_scale.peek())
            self._observed = 0

    def step_summary(self) -> GradientStats | None:
        latest, self._latest = self._latest, None
        return latest
