"""Operator actions from the node's trainspec-agent, applied by every rank at one step.

Rank 0's `ActionClient` collects `POST /v1/actions` requests in the background; at every
`every_steps`-th step boundary rank 0 broadcasts what it has on the control group, and every
rank applies the same list before the next step: checkpoint now, set the compression level
(effective at the hook's next step on all ranks), pause or resume the actuator, dry run on or
off. Each is recorded as an action event. A broadcast that fails is recorded and skipped on
every rank that saw it fail; training goes on.

A checkpoint holds the state the next step runs with: the boundary's other actions are
applied first, whatever order they were asked in, and one save serves every checkpoint asked
for at the boundary. Through `Actuation.boundary_save` the save itself waits for the end of
the boundary, after the controller's changes too (`runtime/checkpoint_boundary.py`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("trainspec.runtime")


class OperatorActions:
    def __init__(self, session: Any, actuation: Any, client: Any, *, every_steps: int = 5) -> None:
        self.session = session
        self.actuation = actuation
        self.client = client  # rank 0 only; None elsewhere
        self.every_steps = every_steps
        self.applied: list[tuple[int, dict[str, Any]]] = []
        self._saved_at: int | None = None  # the step of the last checkpoint asked for
        self._handlers = {
            "checkpoint": self._checkpoint,
            "set_compression": self._set_compression,
            "pause_actuator": lambda step, args: self._pause(True),
            "resume_actuator": lambda step, args: self._pause(False),
            "dry_run": lambda step, args: self._dry_run(bool(args.get("enabled", True))),
        }

    def on_boundary(self, step_index: int) -> None:
        if step_index % self.every_steps:
            return
        import torch.distributed as dist

        box = [self.client.take() if self.client is not None else []]
        groups = self.session.groups
        try:
            if groups is not None:  # one process has no control group and no one to tell
                dist.broadcast_object_list(box, src=0, group=groups.control)
        except Exception as exc:  # a lost rank: the heartbeat and timeouts report it
            self.session.event(
                "fault", "operator_actions", f"broadcast failed: {exc}", severity="error"
            )
            return
        # Saves last: a checkpoint asked for before a `set_compression` at the same boundary
        # saved the old level, and a job resumed from it ran the wrong one.
        actions = sorted(box[0], key=lambda a: a.get("action") == "checkpoint")
        for action in actions:
            self._apply(step_index, action)

    def _apply(self, step: int, action: dict[str, Any]) -> None:
        """Apply one action (the agent's record: id, action, args). Never raises: the same
        failure happens on every rank, is recorded, and training goes on."""
        name = str(action.get("action", ""))
        handler = self._handlers.get(name)
        if handler is None:
            self.session.event(
                "action", "operator", f"unknown operator action {name!r}: not applied"
            )
            return
        try:
            outcome = handler(step, dict(action.get("args") or {}))
        except Exception as exc:
            outcome = f"not applied: {type(exc).__name__}: {exc}"
            log.warning("trainspec: operator action %s failed: %s", name, exc)
        self.applied.append((step, action))
        self.session.event(
            "action",
            "operator",
            f"operator asked for {name}" + (f": {outcome}" if outcome else ""),
            evidence={"agent_action_id": action.get("id"), "request": action},
        )

    def _checkpoint(self, step: int, args: dict[str, Any]) -> str | None:
        save = getattr(self.actuation, "save_checkpoint", None)
        if save is None:
            return "not applied: the job has no checkpoint directory"
        if self._saved_at == step:
            return "the checkpoint of this step already asked for"
        save = getattr(self.actuation, "boundary_save", None) or save
        save(step, "operator: checkpoint now")
        self._saved_at = step
        return None

    def _set_compression(self, step: int, args: dict[str, Any]) -> str | None:
        hook = self.session.hook
        if hook is None:
            return "not applied: no gradient hook (one rank)"
        from trainspec.kernels.codecs import resolve_level

        before = hook.level
        # A plain `int8` is the job's configured block, as in `kernels.compression`.
        level = str(resolve_level(str(args["level"]), self.session.config.kernels.int8_block_size))
        hook.set_level(level)  # at the hook's next step: the same on every rank
        return f"{before} -> {level}"

    def _pause(self, paused: bool) -> str | None:
        controller = getattr(self.actuation, "controller", None)
        if controller is None:
            return "not applied: the actuator is off"
        controller.paused = paused
        return None

    def _dry_run(self, enabled: bool) -> str | None:
        controller = getattr(self.actuation, "controller", None)
        if controller is None:
            return "not applied: the actuator is off"
        controller.dry_run = enabled
        return None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def attach_operator_actions(session: Any, actuation: Any) -> OperatorActions | None:
    """Deliver the node agent's actions when rank 0 has an agent endpoint (every rank joins
    its broadcasts: agreed at init, `session.operator_actions`)."""
    if not session.operator_actions or session.groups is None and session.identity.world_size > 1:
        return None
    client = None
    if session.identity.rank == 0:
        endpoint = session.config.agent.endpoint
        from trainspec.runtime.agent_client import ActionClient

        client = ActionClient(endpoint, run_id=session.run_id).start()
    ops = OperatorActions(
        session, actuation, client, every_steps=session.config.actuator.window_steps
    )
    session.boundary_hooks.append(ops.on_boundary)
    return ops
