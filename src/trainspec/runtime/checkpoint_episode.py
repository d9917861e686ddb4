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

from typing import Any

from trainspec.actuator.control_state import PartStates
from trainspec.actuator.controller import Controller

EPISODE_KEY = "episode"  # in the actuator's saved state
# part name in the saved episode -> the part of a controller (None when it is off)
EPISODE_PARTS = PartStates(
    EPISODE_KEY,
    EPISODE_KEY,
    {"loss": lambda c: c.loss, "checkpoint": lambda c: c.checkpointing},
)
episode_state = EPISODE_PARTS.state  # the reference and the anomaly in progress, JSON-ready
check_episode_state = EPISODE_PARTS.check


def load_episode_state(controller: Controller, state: Any) -> dict[str, Any]:
    """Put `state` (as `episode_state` gave it) back; what was restored, for the `resumed`
    event: the parts, the reference and the anomaly now in progress. A part missing from
    `state` keeps what it has, and one this job has off (no checkpoint policy) is skipped.
    Checked before anything changes: raises StateError, with the controller untouched."""
    names = EPISODE_PARTS.load(controller, state)
    policy = controller.checkpointing
    return {
        "restored": names,
        "loss_reference": controller.loss.state_dict()["reference"],
        "anomaly": policy.anomaly if policy is not None else None,
    }
