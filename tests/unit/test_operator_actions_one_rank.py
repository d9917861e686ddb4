"""Operator actions in a one-process job: no control group to broadcast on, so rank 0 applies
what it took from the agent itself (they were taken from the queue and then lost)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


class SwitchingHook:
    """`set_level` at the next step, as the kernels' hook: `next_level` is what a save holds."""

    level = "int8"
    next_level = "int8"

    def set_level(self, level: str) -> None:
        self.next_level = level


def _session(hook: SwitchingHook, events: list) -> SimpleNamespace:
    return SimpleNamespace(groups=None, hook=hook, event=lambda *a, **k: events.append(a),
                           config=SimpleNamespace(kernels=SimpleNamespace(int8_block_size=64)))  # fmt: skip


def test_a_checkpoint_asked_with_a_level_switch_saves_the_new_level():
    """QA (operator.sh, op_resume.sh): `checkpoint` then `set_compression lowrank:2` taken at
    one boundary saved `int8`, and the job resumed from it ran int8 where it had run lowrank:2.
    A second `checkpoint` at the boundary is the same save, not a second one of the step."""
    events: list[tuple] = []
    hook = SwitchingHook()
    saved: list[tuple[int, str]] = []
    actuation = SimpleNamespace(save_checkpoint=lambda step, reason: saved.append((step, hook.next_level)))  # fmt: skip
    client = Client([{"id": 1, "action": "checkpoint", "args": {}},
                     {"id": 2, "action": "set_compression", "args": {"level": "lowrank:2"}},
                     {"id": 3, "action": "checkpoint", "args": {}}])  # fmt: skip
    ops = OperatorActions(_session(hook, events), actuation, client, every_steps=5)
    ops.on_boundary(35)
    assert saved == [(35, "lowrank:2")]
    assert [a["id"] for _, a in ops.applied] == [2, 1, 3]
    assert "already asked for" in events[-1][2]


def test_a_controller_checkpoint_at_the_boundary_of_an_operator_switch_saves_the_new_level():
    """With window_steps = 1 the controller decides at every operator boundary: its save ran
    in its own hook, before the operator's `set_compression` of the same boundary. Through
    `boundary_save` every save of the boundary is made after its last hook, once."""
    from trainspec.runtime.checkpoint_boundary import BoundarySaves

    events: list[tuple] = []
    hook = SwitchingHook()
    saved: list[tuple[int, str, str]] = []

    def save(step: int, reason: str) -> float:
        saved.append((step, reason, hook.next_level))
        return 2.5

    saves = BoundarySaves(save, lambda *a, **k: events.append(a))
    actuation = SimpleNamespace(save_checkpoint=save, boundary_save=saves)
    client = Client([{"id": 1, "action": "set_compression", "args": {"level": "lowrank:2"}},
                     {"id": 2, "action": "checkpoint", "args": {}}])  # fmt: skip
    ops = OperatorActions(_session(hook, events), actuation, client, every_steps=1)

    def controller(step: int) -> None:  # a Young/Daly checkpoint, through Targets.checkpoint
        assert saves(step, "Young/Daly interval of 40 steps reached") is None  # no cost yet

    for boundary_hook in (controller, ops.on_boundary, saves.flush):  # the session's order
        boundary_hook(36)
    assert saved == [(36, "Young/Daly interval of 40 steps reached; operator: checkpoint now",
                      "lowrank:2")]  # fmt: skip
    assert saves.last_cost == 2.5 and saves.queued == []
    saves.flush(37)
    assert len(saved) == 1  # nothing asked since


@pytest.mark.parametrize("failure", ["os", "dcp"])
def test_a_deferred_save_that_raises_is_recorded_and_the_next_is_made(failure):
    """dcp's CheckpointException is a BaseException: it passed `except Exception`, the
    session took the flush off its hooks, and every later save stayed queued."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainspec.runtime.checkpoint_boundary import BoundarySaves

    events: list[tuple] = []
    calls: list[int] = []

    def save(step: int, reason: str) -> None:
        calls.append(step)
        if step == 5:
            raise OSError("disk full") if failure == "os" else CheckpointException("disk full", {})

    saves = BoundarySaves(save, lambda *a, **k: events.append((a, k)))
    saves(5, "first")
    saves.flush(5)  # does not raise: the session would take the flush off its hooks
    saves(10, "again")
    saves.flush(10)
    assert calls == [5, 10]
    assert [(a[0], a[1]) for a, _ in events] == [("fault", "checkpoint")]
    assert ("OSError: disk full" if failure == "os" else "CheckpointException") in events[0][0][2]
