"""When to checkpoint: the Young/Daly interval from the measured cost, and at once on trouble.

The interval is Young's sqrt(2 * C * M) in steps of the measured mean step time, computed by
`interval_steps(cost_s, step_s)` (the runtime passes runtime/young_daly.py's, with the job's
MTBF); C is the largest checkpoint cost any rank reported. With
no cost measured yet, the first window checkpoints to measure it; a save that reports no
cost (it failed: a full or read-only disk) is tried again after two windows, then after
twice as long each time (at most `MAX_RETRY_WINDOWS` windows apart), until one does: without
a retry a failed first save left the job with no periodic checkpoint to its end. A save
still in flight is not a failed one: a rank reports `PENDING` (+inf) as its cost until its
save completes, and no retry is made while any rank does (a slow save whose cost came a
window late was taken again, one checkpoint too many). Loss spikes, NaN losses,
hardware health flags and preemption checkpoint at once: a spike is saved alongside, before
more updates build on it, so the last good state is not rotated out by periodic saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from trainspec.actuator.findings import Action, Finding
from trainspec.actuator.summary import RankSummary

URGENT = {
    "loss_spike": "loss spike",
    "loss_nan": "non-finite loss",
    "hardware": "hardware health",
    "preemption": "preemption signal",
}
# Windows before the first retry of a save that reported no cost: not one, since an async
# save may still be in flight at the next window; the gap then doubles up to the cap.
FIRST_RETRY_WINDOWS = 2
MAX_RETRY_WINDOWS = 32
# A rank's checkpoint cost while its first save is still in flight: not a measured cost
# (not finite), and not "none" (NaN: no save made, or every one failed).
PENDING = math.inf


@dataclass
class CheckpointPolicy:
    interval_steps: Callable[[float, float], int]  # (cost_s, step_s) -> steps
    last_step: int | None = None
    interval: int | None = None
    _window: int | None = None  # steps between decisions, seen at the first with no cost
    _retries: int = 0  # saves taken again since the first, with no cost measured yet

    def decide(
        self, summaries: list[RankSummary], step: int, findings: list[Finding]
    ) -> Action | None:
        urgent = [f for f in findings if f.kind in URGENT and not f.cleared]
        if urgent:
            names = ", ".join(URGENT[f.kind] for f in urgent)
            return self._take(
                step, f"checkpoint now: {names}", {"triggers": [f.kind for f in urgent]}
            )
        costs = [s.checkpoint_cost_s for s in summaries if math.isfinite(s.checkpoint_cost_s)]
        if not costs:
            return self._measure(
                step, pending=any(s.checkpoint_cost_s == PENDING for s in summaries)
            )
        steps = sum(s.steps for s in summaries)
        step_s = sum(s.duration_s for s in summaries) / steps if steps else 0.0
        if step_s <= 0:
            return None
        cost = max(costs)
        self.interval = self.interval_steps(cost, step_s)
        if self.last_step is not None and step - self.last_step < self.interval:
            return None
        evidence = {"cost_s": cost, "step_s": step_s, "interval_steps": self.interval}
        return self._take(step, f"Young/Daly interval of {self.interval} steps reached", evidence)

    def _measure(self, step: int, *, pending: bool) -> Action | None:
        """No cost reported yet: the first checkpoint, or one more after a backoff; none
        while a save is `pending`, whose cost is late, not lost."""
        last = self.last_step
        if last is not None and self._window is None:
            self._window = max(1, step - last)
        if pending:
            return None
        if last is None:
            return self._take(step, "first checkpoint, to measure its cost", {})
        assert self._window is not None
        windows = min(FIRST_RETRY_WINDOWS << self._retries, MAX_RETRY_WINDOWS)
        if step - last < windows * self._window:
            return None
        self._retries += 1
        reason = (
            f"checkpoint again, to measure its cost: none reported since the one of step {last}"
        )
        return self._take(step, reason, {"retry": self._retries, "after_steps": step - last})

    def _take(self, step: int, reason: str, evidence: dict) -> Action:
        before = {"last_checkpoint_step": self.last_step}
        self.last_step = step
        return Action("checkpoint", reason, before=before, after={"step": step}, evidence=evidence)
