"""What a step's gradient statistics and loss are stored as.

Statistics read during backward (the DDP hook, micro-steps) saw the gradients times a
GradScaler's loss scale s: the norm is divided by s and the variance by s^2 (the noise scale,
their ratio, is unchanged; `loss_scale.py`). A value that is not finite has no place in the
catalogue: non-finite gradients (an overflow that loss scaling then skips, or a diverging
step) store no statistics, and a `nonfinite_gradients` anomaly marks each such step (the
catalogue's `absent_with_event`: the validator excuses the empty values on marked steps only;
the first of a run of them is a warning, the rest info). A non-finite loss is stored as no
value (the loss is optional), with a `nonfinite_loss` anomaly at the first step of each run of
them (NaN or inf failed the run's telemetry for a training problem).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from trainspec.collector import StepRecord
from trainspec.collector.gradients import GradientFigures, GradientSummary
from trainspec.runtime import loss_scale


class StepValues:
    def __init__(self, event: Callable[..., None]) -> None:
        self._event = event  # Session.event
        self._gradients_since: int | None = None  # first step of the current non-finite run
        self._loss_since: int | None = None

    def gradients(
        self, step: int, g: GradientFigures | None, scale: Any, source: Any
    ) -> GradientSummary:
        """`g` in the gradient's own units, without statistics when they are not finite."""
        summary = GradientSummary() if g is None else GradientSummary.of(g)
        return self._finite(step, _unscaled(summary, scale, source))

    def _finite(self, step: int, g: GradientSummary) -> GradientSummary:
        if g.grad_norm is None or math.isfinite(g.grad_norm):
            self._gradients_since = None
            return g
        first = self._gradients_since is None
        if first:
            self._gradients_since = step
        self._event(
            "anomaly", "nonfinite_gradients",
            f"the gradients of step {step} are not finite (norm {g.grad_norm}): no gradient "
            "statistics for it",
            severity="warning" if first else "info",
            evidence={"grad_norm": str(g.grad_norm), "since_step": self._gradients_since},
            step=step,
        )  # fmt: skip
        return dataclasses.replace(g, grad_norm=None, grad_variance=None, grad_noise_scale=None)

    def stored(self, record: StepRecord) -> StepRecord:
        """`record` as the sinks store it: a loss that is not finite as no value."""
        loss = record.loss
        if loss is None or math.isfinite(loss):
            self._loss_since = None
            return record
        if self._loss_since is None:
            self._loss_since = record.step
            self._event(
                "anomaly", "nonfinite_loss",
                f"the loss of step {record.step} is {loss}: not stored, nor while it stays so",
                severity="warning", evidence={"loss": str(loss)}, step=record.step,
            )  # fmt: skip
        return dataclasses.replace(record, loss=None)


def _unscaled(g: GradientSummary, scale: Any, source: Any) -> GradientSummary:
    s = loss_scale.value(scale)
    if s is None or getattr(source, "reads_after_unscale", False):
        return g
    divisors = {"grad_norm": s, "grad_variance": s * s}
    changes = {
        name: getattr(g, name) / divisor
        for name, divisor in divisors.items()
        if getattr(g, name, None) is not None
    }
    return dataclasses.replace(g, **changes)
