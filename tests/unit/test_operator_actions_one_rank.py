"""Operator actions in a one-process job: no control group to broadcast on, so rank 0 applies
what it took from the agent itself (they were taken from the queue and then lost)."""

from __future__ import annotations

from types import SimpleNamespace

from trainspec.runtime.operator_actions import OperatorActions


class Client:
    def __init__(self, actions: list[dict]) -> None:
        self.actions = actions

    def take(self) -> list[dict]:
        out, self.actions = self.actions, []
        return out


def test_a_one_process_job_applies_the_agents_actions():
    events: list[tuple] = []
    session = SimpleNamespace(
        groups=None, hook=None, event=lambda *a, **k: events.append((a, k))
    )  # fmt: skip
    controller = SimpleNamespace(paused=False, dry_run=False)
    client = Client([{"id": 1, "action": "pause_actuator", "args": {}},
                     {"id": 2, "action": "dry_run", "args": {"enabled": True}}])  # fmt: skip
    ops = OperatorActions(session, SimpleNamespace(controller=controller), client, every_steps=5)
    ops.on_boundary(5)
    assert controller.paused and controller.dry_run
    assert [a["id"] for _, a in ops.applied] == [1, 2]
    assert [e[0][0] for e in events] == ["action", "action"]  # no "broadcast failed" fault


class Hook:
    level = "none"

    def set_level(self, level: str) -> None:
        self.level = level


def test_an_operators_plain_int8_is_the_jobs_int8_block():
    """`set_compression int8` in a job with `kernels.int8_block_size = 64` runs block 64, as
    `kernels.compression = "int8"` would; `int8:256` names its own block."""
    events: list[tuple] = []
    hook = Hook()
    session = SimpleNamespace(groups=None, hook=hook, event=lambda *a, **k: events.append(a),
                              config=SimpleNamespace(kernels=SimpleNamespace(int8_block_size=64)))  # fmt: skip
    client = Client([{"id": 1, "action": "set_compression", "args": {"level": "int8"}}])
    ops = OperatorActions(session, SimpleNamespace(), client, every_steps=1)
    ops.on_boundary(1)
    assert hook.level == "int8:64"
    assert events[-1][2].endswith("none -> int8:64")
    client.actions = [{"id": 2, "action": "set_compression", "args": {"level": "int8:256"}}]
    ops.on_boundary(2)
    assert hook.level == "int8"
