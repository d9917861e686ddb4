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
window late was taken again, one checkpoint too many).

Trouble: a loss spike, hardware health flag or preemption flag checkpoints at once, once per
episode: the first window that reports it saves, the windows after it that report it again
do not (a loss that stays high is reported every window, since the spike reference does not
move on spike windows; it saved every window and rotated the last good checkpoint out). An
episode ends with the first window that does not report it. A window with a non-finite loss
on any rank checkpoints nothing, neither at once nor periodically: the state it would save
is the diverged one (one `advice` action per episode says so). While a loss spike or a
non-finite loss is in progress `anomaly` names it; the runtime records that name in each
checkpoint taken meanwhile (runtime/checkpoint_layout.py), and retention always keeps the
newest checkpoint taken before the anomaly began, beside the newest `keep_last`. What the
policy cannot see (a spike window whose weights are already NaN: the loss of the diverging
step is often not reported) the checkpointer measures: a checkpoint whose saved weights are
not finite never counts toward `keep_last` and is loaded only when no finite one is left.

The loss anomaly in progress goes into a checkpoint (`state_dict`, saved with the loss
reference by runtime/checkpoint_episode.py): a job restarted in the middle of one goes on with
it, its windows are no new episode (no checkpoint at once) and its saves are marked with it
as before. Restarted without it, the job marked its saves as taken in no anomaly, and
retention deleted the last checkpoint from before the trouble.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainspec.actuator.findings import Action, Finding
from trainspec.actuator.state_fields import StateError, read_count
from trainspec.actuator.summary import FLAG_NAN_LOSS, RankSummary

URGENT = {
    "loss_spike": "loss spike",
    "loss_nan": "non-finite loss",
    "hardware": "hardware health",
    "preemption": "preemption signal",
}
# Findings that mean the state itself is in doubt: checkpoints taken while one lasts are
# marked with it, and retention keeps the newest one taken before it began.
LOSS_TROUBLE = ("loss_spike", "loss_nan")
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

    # Urgent finding kinds reported by the previous window: an episode in progress, saved once
    _episodes: set[str] = field(default_factory=set)
    _loss_trouble: dict[str, int] = field(default_factory=dict)  # kind -> step it began

    @property
    def anomaly(self) -> str | None:
        """The loss anomaly in progress (e.g. "loss spike since step 16"), None when none:
        a checkpoint taken meanwhile is marked with it, so that retention keeps the newest
        one taken before it."""
        if not self._loss_trouble:
            return None
        since = min(self._loss_trouble.values())
        names = ", ".join(URGENT[kind] for kind in LOSS_TROUBLE if kind in self._loss_trouble)
        return f"{names} since step {since}"

    def state_dict(self) -> dict[str, Any]:
        """The loss anomaly in progress only (kind -> the step it began): the cost and the
        interval are measured again after a restart."""
        return {"loss_trouble": dict(self._loss_trouble)}

    def load_state_dict(self, state: Any) -> None:
        """Go on with the loss anomaly `state` was saved in: reported again, it is no new
        episode, and saves are marked with it since the step it began. A missing key keeps
        what is there; raises StateError naming a bad value, with nothing changed."""
        if not isinstance(state, Mapping):
            raise StateError(f"expected an object, got {type(state).__name__}")
        trouble = state.get("loss_trouble", self._loss_trouble)
        if not isinstance(trouble, Mapping):
            raise StateError(f"loss_trouble must be an object, got {trouble!r:.80}")
        for kind in trouble:
            if kind not in LOSS_TROUBLE:
                raise StateError(f"loss_trouble: {kind!r:.40} is not one of {list(LOSS_TROUBLE)}")
        try:
            began = {kind: read_count(trouble, kind, 0) for kind in trouble}
        except StateError as exc:
            raise StateError(f"loss_trouble.{exc}") from None
        self._episodes = (self._episodes - set(LOSS_TROUBLE)) | set(began)
        self._loss_trouble = began

    def decide(
        self, summaries: list[RankSummary], step: int, findings: list[Finding]
    ) -> Action | None:
        reported = {f.kind for f in findings if f.kind in URGENT and not f.cleared}
        if any(s.flags & FLAG_NAN_LOSS for s in summaries):
            reported.add("loss_nan")
        new = reported - self._episodes
        self._episodes = reported
        for kind in LOSS_TROUBLE:
            if kind not in reported:
                self._loss_trouble.pop(kind, None)
            else:
                self._loss_trouble.setdefault(kind, step)
        if "loss_nan" in reported:  # the state is the diverged one: keep the last good one
            if "loss_nan" not in new:
                return None
            return Action(
                "advice",
                "non-finite loss: no checkpoint of this state while it lasts; the newest "
                "checkpoint with finite weights is kept and is what a resume loads; consider "
                "resuming from it with a lower learning rate",
                evidence={"last_checkpoint_step": self.last_step},
            )
        urgent = [kind for kind in URGENT if kind in new]
        if urgent:
            names = ", ".join(URGENT[kind] for kind in urgent)
            return self._take(step, f"checkpoint now: {names}", {"triggers": urgent})
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
