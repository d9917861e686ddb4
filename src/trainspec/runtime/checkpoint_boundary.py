"""Checkpoints asked for at a step boundary, saved once every boundary hook has run.

At one boundary the controller (`actuator/controller.py`) and the operator's actions
(`runtime/operator_actions.py`) each change the plan the next step runs with (compression
level, shares, micro-batch limit, pause) and each may ask for a checkpoint. A checkpoint
must hold the state the next step runs with, so a save asked for by one of them waits for
the other's changes: `BoundarySaves` queues it, and `flush`, the last boundary hook, saves,
once per step however many asked (two saves of one step would write one directory twice).
Every rank runs the same hooks at the same boundary, so every rank saves alike.

A save that raises is logged and recorded as a `fault` event, never raised: the flush
stays a boundary hook, and later saves are made. A save asked for outside a boundary (the
preemption save of `Actuation.should_stop`) goes to the callback at once through `save_now`,
unless that step was saved at its boundary already: one save per step there too (the
preemption save wrote a second time into the directory the boundary had just committed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.distributed.checkpoint.api import CheckpointException

from trainspec.actuator.actions import CheckpointCallback

log = logging.getLogger("trainspec.actuator")
# dcp's CheckpointException is a BaseException: a script's own callback that saves with dcp
# and fails raised past `except Exception`, took this hook off the boundary and left every
# later save queued for ever (checkpoint.py catches the same pair)
_FAILURES = (Exception, CheckpointException)


class BoundarySaves:
    """A `CheckpointCallback` that queues (`__call__`) and saves at `flush(step_index)`."""

    def __init__(self, save: CheckpointCallback, emit: Callable[..., None]) -> None:
        self._save = save
        self._emit = emit  # session.event
        # The built-in callback's Checkpointer, read for the cost of its latest save
        # (actuation._checkpoint_cost); a script's own callback reports it by returning it.
        self.checkpointer = getattr(save, "checkpointer", None)
        self.last_cost: float | None = None
        self._asked: dict[int, list[str]] = {}  # step -> the reasons, in the order asked
        # The step of the latest save made, whether it raised or not: alike on every rank
        # (they flush the same queued steps), where a save that failed on one rank only
        # would have had that rank alone call a collective callback again at preemption.
        self._saved: int | None = None

    def __call__(self, step: int, reason: str) -> float | None:
        """Queue a save of `step`; returns the cost of the latest save made (this one's
        is known once it is made, after the boundary)."""
        reasons = self._asked.setdefault(step, [])
        if reason not in reasons:
            reasons.append(reason)
        return self.last_cost

    @property
    def queued(self) -> list[tuple[int, str]]:
        """(step, reason) of each save still to be made."""
        return [(step, "; ".join(reasons)) for step, reasons in self._asked.items()]

    def saved(self, step: int) -> bool:
        """True when the latest save made (done or failed) was of `step`."""
        return self._saved == step

    def save_now(self, step: int, reason: str) -> None:
        """Save `step` at once, outside a boundary, unless it was the latest step saved (or
        is queued: it is saved at the flush). Never raises."""
        if step in self._asked or self.saved(step):
            return
        self._make(step, reason)

    def flush(self, step_index: int) -> None:
        """Make the queued saves (the session's last boundary hook). Never raises."""
        queued, self._asked = self.queued, {}
        for step, reason in queued:
            self._make(step, reason)

    def _make(self, step: int, reason: str) -> None:
        self._saved = step
        try:
            cost = self._save(step, reason)
        except _FAILURES as exc:  # a script's callback: recorded, and the job goes on
            log.warning("trainspec: checkpoint of step %d failed: %s", step, exc)
            self._emit("fault", "checkpoint", f"checkpoint of step {step} failed: "
                       f"{type(exc).__name__}: {exc}", severity="error",
                       evidence={"step": step, "reason": reason})  # fmt: skip
            return
        if cost is not None:
            self.last_cost = float(cost)
