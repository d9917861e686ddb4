"""The controller's hysteresis as plain data, saved with a checkpoint and put back on resume.

A resumed job gets back the compression level and micro-batch limit it had (runtime's
`actuator_state`); this is what the controller needs so that it does not at once undo or
redo them. The gradient-regime detector starts a job in a critical regime (Accordion's
observation), which at the first window would lower a restored compression level; the
communication-bound and memory-pressure latches gate raising the level and shrinking the
micro-batch again; the compression and memory policies hold their cool-downs, the last
window's loss and the smallest micro-batch that ran out of memory.

Not saved here: the loss-spike reference and the loss anomaly in progress are saved beside this
state and restored, by runtime/checkpoint_episode.py, so a job restarted in the middle of a
loss spike goes on with the episode. Not saved at all, re-measured after a restart instead:
window accumulators, the straggler detector and the rebalance policy's speed model (the shares
themselves are in the sampler's state), the input-bound latch, the latency-spike baseline,
and the rest of the checkpoint policy (its first window measures the cost again).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from trainspec.actuator.controller import Controller
from trainspec.actuator.state_fields import StateError


class PartStates:
    """Named parts of a controller saved as plain data and put back, each through its own
    `state_dict` / `load_state_dict`; `what` names the whole in errors ("controller state"),
    `prefix` a part ("controller.regime"). Shared by this hysteresis and the loss-spike
    episode (`runtime/checkpoint_episode.py`)."""

    def __init__(
        self, what: str, prefix: str, parts: dict[str, Callable[[Controller], Any]]
    ) -> None:
        self.what, self.prefix, self.parts = what, prefix, parts

    def state(self, controller: Controller) -> dict[str, dict[str, Any]]:
        """Every present part's state, JSON-ready (NaN saved as null)."""
        parts = {name: part(controller) for name, part in self.parts.items()}
        return {name: p.state_dict() for name, p in parts.items() if p is not None}

    def check(self, controller: Controller, state: Any) -> list[str]:
        """The parts of `controller` that `state` would restore, checked on copies (the
        controller is untouched). Raises StateError naming the part and key of a malformed
        value."""
        if not isinstance(state, Mapping):
            raise StateError(f"{self.what} must be an object, got {type(state).__name__}")
        names = []
        for name, part in self.parts.items():
            target = part(controller)
            if name not in state or target is None:
                continue
            try:
                copy.deepcopy(target).load_state_dict(state[name])
            except StateError as exc:
                raise StateError(f"{self.prefix}.{name}: {exc}") from None
            names.append(name)
        return names

    def load(self, controller: Controller, state: Any) -> list[str]:
        """Put `state` (as `state` gave it) back; returns the parts restored. A part missing
        from `state` keeps what it has, and so does a key missing from a part (an older
        checkpoint); a part saved by a job that had it on while this one has it off is
        skipped. Everything is checked before anything changes: raises StateError naming
        the part and key of a malformed value, with the controller untouched."""
        names = self.check(controller, state)
        for name in names:  # checked above, so none of these raises
            self.parts[name](controller).load_state_dict(state[name])
        return names


# part name in the saved state -> the part of a controller (None when it is off)
CONTROLLER_PARTS = PartStates(
    "controller state",
    "controller",
    {
        "regime": lambda c: c.regime,
        "comm_bound": lambda c: c.comm.latch,
        "memory_pressure": lambda c: c.memory,
        "compression": lambda c: c.compression,
        "memory_policy": lambda c: c.memory_policy,
    },
)
controller_state = CONTROLLER_PARTS.state
check_controller_state = CONTROLLER_PARTS.check
load_controller_state = CONTROLLER_PARTS.load
