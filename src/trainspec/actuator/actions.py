"""Applying a decided action to this rank: the sampler, the gradient hook, the checkpointer.

Every rank calls `apply` with the same action at the same step boundary. Rebalance updates
the sampler (which samples each rank draws next) and the hook (the n_r / N weight of this
rank's gradient) together, so the next update is still the full-batch gradient. A level
switch is scheduled for the hook's next step, which every rank reaches together. A memory
action sets the micro-batch limit of this rank's plan; shares and the global batch stay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainspec.actuator.findings import Action

# (step, reason) -> measured cost in seconds of the last completed checkpoint, if known
CheckpointCallback = Callable[[int, str], "float | None"]


class ActionError(RuntimeError):
    """An action could not be applied on this rank (its target refused it)."""


@dataclass
class Targets:
    rank: int
    global_batch: int
    sampler: Any = None  # ShareBatchSampler
    hook: Any = None  # kernels CompressionHook
    checkpoint: CheckpointCallback | None = None
    checkpoint_cost_s: float | None = None
    micro_batch: Any = None  # actuator.micro_batch.MicroBatchPlan
    # The latest completed save's cost, when it completes after the action (async saves)
    checkpoint_cost_source: Callable[[], float | None] | None = None

    def latest_checkpoint_cost(self) -> float | None:
        if self.checkpoint_cost_source is not None:
            cost = self.checkpoint_cost_source()
            if cost is not None:
                self.checkpoint_cost_s = cost
        return self.checkpoint_cost_s

    def can(self, kind: str) -> bool:
        needs = {
            "rebalance": self.sampler is not None and self.hook is not None,
            "compression": self.hook is not None,
            "checkpoint": self.checkpoint is not None,
            "memory": self.micro_batch is not None,
            "advice": True,
        }
        return needs.get(kind, False)


def apply(action: Action, targets: Targets, step: int) -> None:
    """Apply `action` on this rank; raises ActionError when a target refuses it."""
    try:
        _APPLY[action.kind](action, targets, step)
    except (ValueError, RuntimeError) as exc:
        raise ActionError(f"{action.kind} failed on rank {targets.rank}: {exc}") from exc


def _rebalance(action: Action, t: Targets, step: int) -> None:
    shares = [int(s) for s in action.after["shares"]]
    t.sampler.set_shares(shares)
    t.hook.set_shares(shares[t.rank], t.global_batch)


def _compression(action: Action, t: Targets, step: int) -> None:
    t.hook.set_level(action.after["level"], at_step=t.hook.step)


def _checkpoint(action: Action, t: Targets, step: int) -> None:
    assert t.checkpoint is not None
    cost = t.checkpoint(step, action.reason)
    if cost is not None:
        t.checkpoint_cost_s = float(cost)


def _memory(action: Action, t: Targets, step: int) -> None:
    t.micro_batch.set_limit(int(action.after["limit"]))


def _advice(action: Action, t: Targets, step: int) -> None:
    """Advice changes nothing; its event is the whole of it."""


_APPLY: dict[str, Callable[[Action, Targets, int], None]] = {
    "rebalance": _rebalance,
    "compression": _compression,
    "checkpoint": _checkpoint,
    "memory": _memory,
    "advice": _advice,
}
