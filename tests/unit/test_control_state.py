"""The controller's hysteresis saved and put back: a resumed controller must not at once undo
what the job had done. A fresh gradient-regime detector starts critical, so at the first
window the compression policy lowered a restored int8 level; a fresh memory policy grew a
shrunk micro-batch back after three clear windows."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from trainspec.actuator import Controller, Targets
from trainspec.actuator.control_state import (
    check_controller_state,
    controller_state,
    load_controller_state,
)
from trainspec.actuator.micro_batch import MicroBatchPlan
from trainspec.actuator.state_fields import StateError
from trainspec.actuator.summary import RankSummary
from trainspec.collector.records import StepRecord
from trainspec.config import ActuatorConfig
from trainspec.data import ShareBatchSampler

pytestmark = pytest.mark.timeout(60)


class LevelHook:
    """The part of the CompressionHook the controller drives: its level and step."""

    def __init__(self, level: str) -> None:
        self.level, self.step = level, 0

    def set_shares(self, local: int, total: int) -> None:
        pass

    def set_level(self, level: str, at_step: int | None = None) -> None:
        self.level = level


def both_ranks(mine: RankSummary, group: object) -> Callable[[], list[RankSummary]]:
    """The all-gather of a two-rank job whose other rank saw the same window."""
    peer = RankSummary.from_list(mine.to_list())
    peer.rank = 1
    return lambda: [mine, peer]


def make(level: str = "int8", limit: int = 4) -> tuple[Controller, LevelHook, MicroBatchPlan]:
    config = ActuatorConfig(rebalance=False, checkpoint=False, patience=2, window_steps=5)
    hook = LevelHook(level)
    plan = MicroBatchPlan(8, 1)
    plan.set_limit(limit)
    targets = Targets(
        rank=0,
        global_batch=16,
        sampler=ShareBatchSampler(1000, 16, rank=0, world_size=2),
        hook=hook,
        micro_batch=plan,
    )
    ctl = Controller(
        config, world_size=2, group=None, targets=targets, emit=lambda *a, **k: None,
        gather=both_ranks,
    )  # fmt: skip
    return ctl, hook, plan


def run_windows(ctl: Controller, windows: int, start: int = 0) -> None:
    """Quiet windows: no communication wait, no memory pressure, a steady loss and norm."""
    for step in range(start, start + 5 * windows + 1):
        ctl.on_record(StepRecord(ts=0, rank=0, step=step, duration_s=0.1, forward_s=0.03,
                                 backward_s=0.06, samples=8, loss=2.0, grad_norm=1.0))  # fmt: skip
        ctl.on_boundary(step + 1)


def saved_mid_run() -> dict:
    """The state of a controller that had raised compression to int8 and shrunk the
    micro-batch to 4 under pressure, as a checkpoint's JSON holds it."""
    ctl, _, _ = make()
    ctl.regime.critical, ctl.regime._previous = False, 1.0
    ctl.memory.latch.active, ctl.memory.pressed = True, False
    assert ctl.compression is not None and ctl.memory_policy is not None
    ctl.compression._cooling, ctl.compression._last_loss = 0, 2.0
    ctl.memory_policy._since_change, ctl.memory_policy._clear = 1, 0
    ctl.memory_policy._ceiling = 8
    return json.loads(json.dumps(controller_state(ctl)))


def test_the_state_round_trips_through_json() -> None:
    state = saved_mid_run()
    fresh, _, _ = make()
    assert load_controller_state(fresh, state) == [
        "regime", "comm_bound", "memory_pressure", "compression", "memory_policy"
    ]  # fmt: skip
    assert controller_state(fresh) == state
    assert state["regime"] == {"critical": False, "previous_grad_norm": 1.0}
    assert state["memory_policy"] == {"since_change": 1, "clear": 0, "ceiling": 8}


def test_a_restored_controller_keeps_the_level_and_limit_a_fresh_one_undoes() -> None:
    fresh, fresh_hook, fresh_plan = make()
    run_windows(fresh, 4)
    assert fresh_hook.level == "bf16"  # a fresh regime detector says "critical": lowered at once
    assert fresh_plan.limit == 8  # pressure unseen: grown back after three clear windows

    restored, hook, plan = make()
    load_controller_state(restored, saved_mid_run())
    run_windows(restored, 4)
    assert hook.level == "int8"
    assert plan.limit == 4  # the detector must see `patience` clear windows first, then cool down
    assert [h["kind"] for h in restored.history] == []


def test_missing_parts_and_keys_keep_the_defaults() -> None:
    ctl, _, _ = make()
    before = controller_state(ctl)
    assert load_controller_state(ctl, {}) == []
    assert load_controller_state(ctl, {"regime": {}, "memory_policy": {"clear": 2}}) == [
        "regime", "memory_policy"
    ]  # fmt: skip
    after = controller_state(ctl)
    assert after["regime"] == before["regime"] and math.isnan(ctl.regime._previous)
    assert after["memory_policy"] == {**before["memory_policy"], "clear": 2}


def test_a_part_this_job_has_off_is_skipped() -> None:
    ctl, _, _ = make()
    ctl.compression = None
    assert "compression" not in load_controller_state(ctl, saved_mid_run())
    assert "compression" not in controller_state(ctl)


@pytest.mark.parametrize(
    ("state", "words"),
    [
        ([], "controller state must be an object"),
        ({"regime": "critical"}, "controller.regime: expected an object"),
        ({"regime": {"critical": 1}}, "controller.regime: critical must be true or false"),
        ({"comm_bound": {"run": -1}}, "controller.comm_bound: run must be a whole number"),
        ({"compression": {"last_loss": "2.0"}}, "controller.compression: last_loss must be a"),
        ({"memory_policy": {"ceiling": 2.5}}, "controller.memory_policy: ceiling must be a whole"),
        ({"memory_pressure": {"pressed": None}}, "controller.memory_pressure: pressed must be"),
    ],
)
def test_a_malformed_value_is_named_and_nothing_changes(state: object, words: str) -> None:
    ctl, _, _ = make()
    before = controller_state(ctl)
    good_then_bad = {"regime": {"critical": False}, **state} if isinstance(state, dict) else state
    with pytest.raises(StateError, match=words):
        check_controller_state(ctl, good_then_bad)
    with pytest.raises(StateError, match=words):
        load_controller_state(ctl, good_then_bad)
    assert controller_state(ctl) == before  # the valid regime part was not applied either


def test_a_checkpoint_decided_with_a_memory_action_saves_the_shrunk_limit() -> None:
    """The checkpoint is applied after the window's other actions, so it holds the plan the
    next step runs: before, the memory action came after it and the save held the old limit,
    which a resumed job would then run with under the same pressure."""
    config = ActuatorConfig(rebalance=False, compression=False, patience=1, window_steps=5)
    plan = MicroBatchPlan(8, 1)
    saved: list[int] = []
    targets = Targets(
        rank=0,
        global_batch=16,
        sampler=ShareBatchSampler(1000, 16, rank=0, world_size=2),
        checkpoint=lambda step, reason: saved.append(plan.limit) or 0.1,
        micro_batch=plan,
    )
    ctl = Controller(
        config, world_size=2, group=None, targets=targets, emit=lambda *a, **k: None,
        gather=both_ranks, memory_probe=lambda: (0.99, 0.0),
        checkpoint_interval=lambda cost_s, step_s: 1000,
    )  # fmt: skip
    run_windows(ctl, 1)
    kinds = [h["kind"] for h in ctl.history if h["applied"]]
    assert kinds == ["memory", "checkpoint"]
    assert saved == [4] and plan.limit == 4
