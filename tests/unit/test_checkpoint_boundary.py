"""`actuate()` with operator actions on: every checkpoint asked for at a step boundary (the
controller's, the operator's) is made after the boundary's last hook, through one
`BoundarySaves` (runtime/checkpoint_boundary.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainspec.runtime import actuation as actuation_module
from trainspec.runtime.checkpoint_boundary import BoundarySaves


class _Client:
    def __init__(self, *args, **kwargs) -> None:
        self.actions: list[dict] = []

    def start(self) -> _Client:
        return self

    def take(self) -> list[dict]:
        out, self.actions = self.actions, []
        return out

    def close(self) -> None:
        pass


@pytest.mark.timeout(60)
def test_the_controller_and_the_operator_save_through_the_boundarys_last_hook(
    ts, tmp_path, monkeypatch
):
    import trainspec.runtime.agent_client as agent_client

    monkeypatch.setattr(agent_client, "ActionClient", _Client)
    given: list = []

    def controller(session, sampler, global_batch, checkpoint, *rest):
        given.append(checkpoint)
        hook = SimpleNamespace(on_boundary=lambda step: checkpoint(step, "Young/Daly"))
        session.boundary_hooks.append(hook.on_boundary)
        return SimpleNamespace(on_boundary=hook.on_boundary, close=lambda: None)

    monkeypatch.setattr(actuation_module, "_controller", controller)
    ts.operator_actions = True  # as init agrees when rank 0 has an agent endpoint
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ts.actuate(dataset_len=64, global_batch=8, checkpoint_dir=str(tmp_path / "ckpt"),
                     model=model, optimizer=optimizer)  # fmt: skip
    act.state.controller = None  # the stand-in has no detectors' state to save
    try:
        saves = act.boundary_save
        assert isinstance(saves, BoundarySaves) and given == [saves]
        hooks = ts.boundary_hooks
        assert hooks.index(act.operator.on_boundary) < hooks.index(saves.flush) == len(hooks) - 1
        act.operator.client.actions = [{"id": 1, "action": "checkpoint", "args": {}}]
        ts.step_index = 5
        for hook in list(hooks):
            hook(5)
        act.checkpointer.wait()
        record = act.checkpointer.last_saved
        assert record is not None and record.step == 5  # one save for both asks
        assert record.reason == "Young/Daly; operator"
    finally:
        act.close()
    assert saves.flush not in ts.boundary_hooks


def test_a_controller_checkpoint_holds_its_own_level_switch_of_the_same_boundary():
    """Within one decision the controller applies its checkpoint last (controller._decide):
    the save sees the level switch decided beside it, as the next step will run it."""
    from tests.unit.test_actuator_controller import Peer, make, run_steps
    from trainspec.actuator.checkpointing import CheckpointPolicy
    from trainspec.actuator.findings import Action
    from trainspec.config import ActuatorConfig

    peer = Peer(per_sample_s=0.01)
    peer.version = -1  # the peer applies what this rank applies
    config = ActuatorConfig(rebalance=False, patience=2, window_steps=5)
    ctl, sampler, hook, _ = make(config, peer)
    switch = Action("compression", "raise", before={"level": "none"}, after={"level": "int8"})
    ctl.compression = SimpleNamespace(decide=lambda *a, **k: switch)
    seen: list[tuple[int, list]] = []
    ctl.targets.checkpoint = lambda step, reason: seen.append((step, list(hook.calls)))
    ctl.checkpointing = CheckpointPolicy(lambda cost, step_s: 10**6)
    run_steps(ctl, sampler, 6)  # the first window, decided at step 6: switch and checkpoint
    assert seen == [(6, [("set_level", "int8", 0)])]


def test_the_preemption_save_of_a_step_saved_at_its_boundary_is_not_made_again():
    """`should_stop` saved the step the boundary had just saved, through the script's own
    callback a second time (QA B2)."""
    made: list[tuple[int, str]] = []

    def callback(step: int, reason: str) -> None:
        made.append((step, reason))

    saves = BoundarySaves(callback, lambda *a, **k: None)
    act = actuation_module.Actuation(
        SimpleNamespace(), SimpleNamespace(), None, 0, save_checkpoint=callback,
        boundary_save=saves, preemption=SimpleNamespace(should_stop=lambda: True,
                                                        disarm=lambda: None),
    )  # fmt: skip
    saves(6, "first checkpoint")  # the controller, at the boundary of step 6
    saves.flush(6)
    assert act.should_stop(6) is True
    assert made == [(6, "first checkpoint")]
    assert act.should_stop(7) is True  # a step not saved yet is saved at once
    assert made == [(6, "first checkpoint"), (7, "preemption: SIGTERM received")]


def test_a_boundary_save_that_failed_is_not_made_again_at_preemption():
    """Whether the preemption saves again must be alike on every rank: a callback that
    raised on one rank only (a local disk) had that rank alone call it again, and a
    collective callback (dcp.save, a barrier) then waited for the others until it timed out
    (review, 2026-11-28). A save made at the boundary counts, done or failed."""
    made: list[int] = []

    def callback(step: int, reason: str) -> None:
        made.append(step)
        raise OSError("No space left on device")

    saves = BoundarySaves(callback, lambda *a, **k: None)
    saves(40, "young-daly")
    saves.flush(40)
    assert made == [40] and saves.saved(40)
    saves.save_now(40, "preemption: SIGTERM received")
    assert made == [40]
