"""The loss-spike episode in a checkpoint, so a job restarted in the middle of one goes on with it.

Saved under "episode" in the actuator's state (`runtime/actuator_state.py`), shared like the
controller's hysteresis (every rank applies rank 0's):

- "loss": the loss-spike detector's running reference (`actuator/loss.py`), the loss before
  the trouble: spiking windows do not move it;
- "checkpoint": the loss anomaly in progress, kind -> the step it began
  (`actuator/checkpointing.py`).

Without them a job restarted in the middle of a loss-spike episode measured its reference
afresh at the high loss, saw no spike, and marked its later saves as taken in no anomaly, so
retention (`keep_last`) deleted the last checkpoint from before the trouble. With them its
windows still report the spike, which is no new episode (no checkpoint at once), and its
saves are marked "loss spike since step S" with the first job's S: retention keeps the newest
checkpoint taken before S. A checkpoint without this key (an older trainspec) restores
nothing here: the detector and the policy start afresh, as they did.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from trainspec.actuator.controller import Controller
from trainspec.actuator.state_fields import StateError

EPISODE_KEY = "episode"  # in the actuator's saved state
# part name in the saved episode -> the part of a controller (None when it is off)
_PARTS: dict[str, Callable[[Controller], Any]] = {
    "loss": lambda c: c.loss,
    "checkpoint": lambda c: c.checkpointing,
}


def episode_state(controller: Controller) -> dict[str, dict[str, Any]]:
    """The reference and the anomaly in progress as of now, JSON-ready (NaN saved as null)."""
    parts = {name: part(controller) for name, part in _PARTS.items()}
    return {name: p.state_dict() for name, p in parts.items() if p is not None}


def check_episode_state(controller: Controller, state: Any) -> list[str]:
    """The parts of `controller` that `state` would restore, checked on copies (the controller
    is untouched). Raises StateError naming the part and key of a malformed value."""
    if not isinstance(state, Mapping):
        raise StateError(f"{EPISODE_KEY} must be an object, got {type(state).__name__}")
    names = []
    for name, part in _PARTS.items():
        target = part(controller)
        if name not in state or target is None:
            continue
        try:
            copy.deepcopy(target).load_state_dict(state[name])
        except StateError as exc:
            raise StateError(f"{EPISODE_KEY}.{name}: {exc}") from None
        names.append(name)
    return names


def load_episode_state(controller: Controller, state: Any) -> dict[str, Any]:
    """Put `state` (as `episode_state` gave it) back; what was restored, for the `resumed`
    event: the parts, the reference and the anomaly now in progress. A part missing from
    `state` keeps what it has, and one this job has off (no checkpoint policy) is skipped.
    Checked before anything changes: raises StateError, with the controller untouched."""
    names = check_episode_state(controller, state)
    for name in names:  # checked above, so none of these raises
        _PARTS[name](controller).load_state_dict(state[name])
    policy = controller.checkpointing
    return {
        "restored": names,
        "loss_reference": controller.loss.state_dict()["reference"],
        "anomaly": policy.anomaly if policy is not None else None,
    }
