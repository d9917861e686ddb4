"""The control API's actions: validated, numbered, kept for the ranks to collect.

`POST /v1/actions` takes one JSON object:
    {"action": "checkpoint"}
    {"action": "set_compression", "level": "none" | "bf16" | "int8[:B]"
                                         | "lowrank:R[:W[:int8|:exact]]"
                                         | "lowrank-bf16:R[:W[:int8|:exact]]"
                                         | "topk:F" (0 < F <= 1)}
    {"action": "pause_actuator"} / {"action": "resume_actuator"}
    {"action": "dry_run", "enabled": true | false}
and optionally "run_id" (default: every run on this node). Each accepted action gets the next
id; rank 0's client (`runtime/agent_client.py`) polls `GET /v1/actions?after=<last id>` on a
thread, and `runtime/operator_actions.py` broadcasts what it got on the control group at a
step boundary so every rank applies it at the same step.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from trainspec.levels import is_level, level_error
from trainspec.store.layout import check_run_id

ACTIONS: dict[str, dict[str, type]] = {
    "checkpoint": {},
    "set_compression": {"level": str},
    "pause_actuator": {},
    "resume_actuator": {},
    "dry_run": {"enabled": bool},
}
MAX_QUOTED = 64  # characters of a bad level quoted back in the refusal


def is_compression_level(text: str) -> bool:
    """A level name as the ranks will parse it (`trainspec.levels`, no torch); they parse it
    again when applying it."""
    return is_level(text)


def compression_level_error(text: str) -> str | None:
    """Why `text` is no level, as the ranks' parser says it (None: a level); a text too long
    to quote back is said by its length."""
    reason = level_error(text)
    if reason is None or len(text) <= MAX_QUOTED:
        return reason
    return f"a level of {len(text)} characters is no compression level"


MAX_KEPT = 1000


class BadAction(ValueError):
    """A control request that is not a valid action; the message says why."""


@dataclass(frozen=True)
class Action:
    id: int
    action: str
    args: dict[str, Any]
    run_id: str  # "" = every run
    received_at: float


def parse_action(body: bytes) -> tuple[str, dict[str, Any], str]:
    """(action, args, run_id) from a request body; BadAction names what is wrong."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadAction(f"body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadAction("body is nested too deeply") from exc
    if not isinstance(doc, dict):
        raise BadAction("body must be a JSON object")
    name = doc.get("action")
    if not isinstance(name, str):  # a list or object is no action (nor hashable)
        raise BadAction(f"action must be a string, one of {sorted(ACTIONS)}")
    if name not in ACTIONS:
        raise BadAction(f"action {name!r} is not one of {sorted(ACTIONS)}")
    run_id = doc.get("run_id", "")
    if not isinstance(run_id, str):
        raise BadAction("run_id must be a string")
    if run_id:  # "" is every run; any other is a run directory's name, as batches send
        try:
            check_run_id(run_id)
        except ValueError as exc:
            raise BadAction(f"run_id: {exc}") from exc
    spec = ACTIONS[name]
    extra = set(doc) - set(spec) - {"action", "run_id"}
    if extra:
        raise BadAction(f"{name}: unexpected fields {sorted(extra)}")
    args: dict[str, Any] = {}
    for key, typ in spec.items():
        if key not in doc or type(doc[key]) is not typ:
            raise BadAction(f"{name}: field {key!r} must be a {typ.__name__}")
        args[key] = doc[key]
    reason = compression_level_error(args["level"]) if name == "set_compression" else None
    if reason is not None:
        raise BadAction(f"set_compression: {reason}")
    return name, args, run_id


class ActionLog:
    """Numbered actions, the last `MAX_KEPT` of them, readable after a given id."""

    def __init__(self) -> None:
        self._actions: list[Action] = []
        self._next = 1
        self._lock = threading.Lock()
        # Ids restart with the agent; the epoch tells a client to start over from 0.
        self.epoch = uuid.uuid4().hex[:12]

    def add(self, name: str, args: dict[str, Any], run_id: str) -> Action:
        with self._lock:
            action = Action(self._next, name, args, run_id, time.time())
            self._next += 1
            self._actions = [*self._actions[-(MAX_KEPT - 1) :], action]
            return action

    def after(self, last_id: int, run_id: str = "") -> list[dict[str, Any]]:
        with self._lock:
            return [
                asdict(a)
                for a in self._actions
                if a.id > last_id and (not a.run_id or not run_id or a.run_id == run_id)
            ]

    def count(self) -> int:
        with self._lock:
            return self._next - 1
