"""The actuator's own state through a checkpoint (runtime/actuator_state.py), on one rank with
a real DDP model and CompressionHook: the level and micro-batch limit in force and the error
feedback come back; a checkpoint without them changes nothing; a malformed value is a
CheckpointError naming it, with nothing applied. Before, a resumed job started at the
configured level and micro-batch with no error feedback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.actuator.micro_batch import MicroBatchPlan
from trainspec.kernels.hook import CompressionHook
from trainspec.runtime import rank_tensors
from trainspec.runtime.actuator_state import ActuatorState
from trainspec.runtime.checkpoint_layout import CheckpointError, rank_tensors_path

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


class Job:
    """One rank's DDP model, its gradient hook, micro-batch plan and actuator state. The model
    has one parameter, so DDP's bucket is the same at a restart's first step as after the
    rebuild the first run made, and the int8 codec's blocks fall alike: updates compare bit
    for bit."""

    def __init__(self, level: str = "none", micro_batch: int = 8, minimum: int = 1) -> None:
        torch.manual_seed(0)
        self.model = DDP(torch.nn.Linear(16, 4, bias=False))
        self.hook = CompressionHook(level)
        self.hook.register(self.model)
        self.plan = MicroBatchPlan(micro_batch, minimum)
        self.state = ActuatorState(
            hook=self.hook, plan=self.plan, model=self.model, configured_level=level, rank=0,
            group=None,
        )  # fmt: skip

    def step(self, seed: int) -> torch.Tensor:
        """One backward; the gradient the hook's exchange gave back."""
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        self.model.zero_grad()
        self.model(x).pow(2).mean().backward()
        return self.model.module.weight.grad.clone()


def save(job: Job, ckpt: Path) -> dict[str, Any]:
    """What the built-in checkpointer writes: the JSON state and the rank's tensor file."""
    state, tensors = job.state.snapshot()
    (ckpt / "extra").mkdir(parents=True, exist_ok=True)
    if tensors:
        rank_tensors.write(ckpt, 0, tensors)
    return json.loads(json.dumps(state))  # what reading the checkpoint's JSON gives back


def moved_job() -> Job:
    """A job the actuator moved: int8 from step 2, the micro-batch shrunk after an OOM at 4."""
    job = Job("none")
    for seed in range(2):
        job.step(seed)
    job.hook.set_level("int8", at_step=job.hook.step)
    job.plan.shrink_after_oom(4)
    for seed in range(2, 5):
        job.step(seed)
    return job


def test_level_limit_and_error_feedback_come_back_and_the_next_update_is_the_same(
    tmp_path: Path,
) -> None:
    job = moved_job()
    state = save(job, tmp_path)
    assert state["actuator"]["compression"] == {"level": "int8", "configured": "none"}
    assert state["actuator"]["micro_batch"] == {"limit": 2, "oom_at": 4, "configured": 8}
    assert state["actuator"]["error_feedback"] == {"parameters": 1}
    saved = job.hook.error_feedback()
    assert len(saved) == 1 and next(iter(saved.values())).abs().sum() > 0

    resumed = Job("none")
    resumed.model.module.load_state_dict(job.model.module.state_dict())
    evidence = resumed.state.restore(state, tmp_path)
    assert evidence["restored"] and evidence["compression"]["restored"]
    assert evidence["micro_batch"] == {"restored": True, "limit": 2, "oom_at": 4}
    assert evidence["error_feedback"] == {"parameters": 1}
    assert resumed.hook.next_level == "int8" and resumed.hook.level == "none"  # from the next step
    assert (resumed.plan.limit, resumed.plan.oom_at) == (2, 4)
    pieces = resumed.hook.error_feedback()
    assert [torch.equal(a, b) for a, b in zip(pieces.values(), saved.values())] == [True]
    # The next step's exchange adds the same residual to the same gradient: the same update.
    assert torch.equal(resumed.step(5), job.step(5))
    assert resumed.hook.level == "int8"
    assert torch.equal(resumed.step(6), job.step(6))


def test_without_the_error_feedback_the_next_update_differs(tmp_path: Path) -> None:
    """The check above has teeth: the residual is what makes the two updates equal."""
    job = moved_job()
    state = save(job, tmp_path)
    rank_tensors_path(tmp_path, 0).unlink()
    state["actuator"]["error_feedback"]["parameters"] = 0
    resumed = Job("none")
    resumed.model.module.load_state_dict(job.model.module.state_dict())
    resumed.state.restore(state, tmp_path)
    assert not torch.equal(resumed.step(5), job.step(5))


def test_a_checkpoint_without_actuator_state_changes_nothing(tmp_path: Path) -> None:
    job = Job("bf16")
    evidence = job.state.restore({}, tmp_path)
    assert evidence["restored"] is False and "no actuator state" in evidence["why"]
    assert (job.hook.next_level, job.plan.limit, job.hook.error_feedback()) == ("bf16", 8, {})


def test_missing_keys_keep_their_defaults(tmp_path: Path) -> None:
    job = Job("bf16")
    evidence = job.state.restore({"actuator": {"version": 1}}, tmp_path)
    assert evidence["compression"] == {"restored": False, "why": "not saved"}
    assert evidence["micro_batch"]["restored"] is False
    assert (job.hook.next_level, job.plan.limit, job.plan.oom_at) == ("bf16", 8, 0)
    job.state.restore({"actuator": {"micro_batch": {"limit": 4}}}, tmp_path)
    assert (job.plan.limit, job.plan.oom_at) == (4, 0)


def test_a_pending_reset_saves_no_error_feedback(tmp_path: Path) -> None:
    job = moved_job()
    job.hook.set_level("bf16", at_step=job.hook.step, reset_error_feedback=True)
    state, tensors = job.state.snapshot()
    assert tensors == {} and state["actuator"]["error_feedback"] == {"parameters": 0}
    assert state["actuator"]["compression"]["level"] == "bf16"


@pytest.mark.parametrize(
    ("actuator", "words"),
    [
        ([1], "actuator must be an object"),
        ({"version": 3}, "actuator.version 3: this trainspec reads versions 1 to 2"),
        ({"version": "1"}, "actuator.version must be a whole number"),
        ({"compression": {"level": "int4"}}, "actuator.compression.level: .*int4"),
        ({"compression": {"level": 8}}, "actuator.compression.level must be a compression"),
        ({"compression": "int8"}, "actuator.compression must be an object"),
        ({"micro_batch": {"limit": -2}}, "actuator.micro_batch.limit must be a whole number"),
        ({"micro_batch": {"limit": "4"}}, "actuator.micro_batch.limit must be a whole number"),
        ({"micro_batch": {"oom_at": True}}, "actuator.micro_batch.oom_at must be a whole"),
        ({"controller": []}, "actuator.controller must be an object"),
        ({"error_feedback": {"parameters": 3}}, "parameters is 3, but rank 0's tensor file"),
    ],
)
def test_a_malformed_value_is_a_checkpoint_error_naming_it(
    tmp_path: Path, actuator: object, words: str
) -> None:
    job = Job("none")
    good = {"compression": {"level": "int8", "configured": "none"}, "micro_batch": {"limit": 2}}
    state = {"actuator": {**good, **actuator} if isinstance(actuator, dict) else actuator}
    with pytest.raises(CheckpointError, match=words):
        job.state.restore(state, tmp_path)
    assert (job.hook.next_level, job.plan.limit) == ("none", 8)  # nothing applied


def test_a_malformed_controller_value_is_named(tmp_path: Path) -> None:
    from trainspec.actuator import Controller, Targets
    from trainspec.config import ActuatorConfig

    job = Job("none")
    targets = Targets(rank=0, global_batch=16, hook=job.hook, micro_batch=job.plan)
    job.state.controller = Controller(
        ActuatorConfig(), world_size=2, group=None, targets=targets, emit=lambda *a, **k: None
    )
    state = {"actuator": {"micro_batch": {"limit": 2}, "controller": {"regime": {"critical": 0}}}}
    with pytest.raises(CheckpointError, match="actuator.controller.regime: critical must be"):
        job.state.restore(state, tmp_path)
    assert job.plan.limit == 8


@pytest.mark.parametrize(
    ("tensors", "words"),
    [
        ({"module.bias": torch.zeros(4)}, "module.bias: the model has no such parameter"),
        ({"module.weight": torch.zeros(63)}, "module.weight: 63 torch.float32 values, the param"),
        ({"module.weight": torch.zeros(64, dtype=torch.int64)}, "module.weight: 64 torch.int64"),
    ],
)
def test_error_feedback_that_fits_no_parameter_is_named(
    tmp_path: Path, tensors: dict, words: str
) -> None:
    job = Job("none")
    (tmp_path / "extra").mkdir()
    rank_tensors.write(tmp_path, 0, tensors)
    state = {"actuator": {"error_feedback": {"parameters": 1}}}
    with pytest.raises(CheckpointError, match=words):
        job.state.restore(state, tmp_path)
    assert job.hook.error_feedback() == {}


def test_an_unreadable_tensor_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "extra").mkdir()
    rank_tensors_path(tmp_path, 0).write_bytes(b"not a torch file")
    state = {"actuator": {"error_feedback": {"parameters": 1}}}
    with pytest.raises(CheckpointError, match=r"rank0\.tensors\.pt: unreadable"):
        Job("none").state.restore(state, tmp_path)
    torch.save([torch.zeros(1)], rank_tensors_path(tmp_path, 0))
    with pytest.raises(CheckpointError, match="not a mapping of names to tensors"):
        Job("none").state.restore(state, tmp_path)


def test_a_configuration_changed_since_the_save_wins(tmp_path: Path) -> None:
    state = save(moved_job(), tmp_path)
    other_level = Job("bf16")  # kernels.compression changed from none to bf16
    evidence = other_level.state.restore(state, tmp_path)
    assert not evidence["compression"]["restored"] and other_level.hook.next_level == "bf16"
    assert "kernels.compression is bf16, was none" in evidence["compression"]["why"]
    assert other_level.plan.limit == 2  # the micro-batch configuration did not change

    other_micro = Job("none", micro_batch=16)
    evidence = other_micro.state.restore(state, tmp_path)
    assert (
        other_micro.plan.limit == 16
        and "configured micro-batch is 16, was 8" in (evidence["micro_batch"]["why"])
    )
    assert other_micro.hook.next_level == "int8"

    higher_floor = Job("none", minimum=3)
    evidence = higher_floor.state.restore(state, tmp_path)
    assert higher_floor.plan.limit == 8
    assert "limit 2 is below actuator.min_micro_batch 3" in evidence["micro_batch"]["why"]


def test_any_failure_on_a_rank_is_its_verdict_and_the_gather_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OverflowError (a 400-digit number) or any other exception skipped the gather on
    that rank: the others waited out the control group's timeout for it."""
    from trainspec.actuator import Controller, Targets
    from trainspec.config import ActuatorConfig

    job = Job("none")
    targets = Targets(rank=0, global_batch=16, hook=job.hook, micro_batch=job.plan)
    job.state.controller = Controller(
        ActuatorConfig(), world_size=2, group=None, targets=targets, emit=lambda *a, **k: None
    )
    gathered: list[Any] = []
    real_gather = job.state._gather
    monkeypatch.setattr(job.state, "_gather", lambda v: gathered.append(v) or real_gather(v))
    huge = json.loads(
        '{"actuator": {"controller": {"regime": {"previous_grad_norm": 1' + "0" * 400 + "}}}}"
    )
    with pytest.raises(CheckpointError, match="previous_grad_norm must be a number a float"):
        job.state.restore(huge, tmp_path)
    monkeypatch.setattr(
        job.state, "_pieces", lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    (tmp_path / "extra").mkdir()
    rank_tensors.write(tmp_path, 0, {"module.weight": torch.zeros(64)})
    with pytest.raises(CheckpointError, match="rank 0: actuator: RuntimeError: boom"):
        job.state.restore({"actuator": {"error_feedback": {"parameters": 1}}}, tmp_path)
    assert len(gathered) == 2 and all(problem for problem, _ in gathered)


def test_two_models_save_and_restore_the_actuated_model_s_error_feedback_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second model beside actuate's (a HookSet over both): the checkpoint holds the
    actuated model's error feedback, with no warning about the other's, and a restore gives
    it back to that model and leaves the other's as it was."""
    from trainspec.runtime.hook_set import HookSet
    from trainspec.runtime.hook_wiring import HOOKED

    job = moved_job()
    other = DDP(torch.nn.Linear(16, 2, bias=False))
    other_hook = CompressionHook("int8")
    other_hook.register(other)
    for m, h in ((job.model, job.hook), (other, other_hook)):
        vars(m)[HOOKED] = h  # as Session.attach_hook marks a model it hooked
    both = HookSet(
        [job.hook, other_hook], [{id(p) for p in m.parameters()} for m in (job.model, other)]
    )
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(9))
    other(x).pow(2).mean().backward()
    other_residual = dict(other_hook.error_feedback())
    assert len(other_residual) == 1
    job.state = ActuatorState(
        hook=both, plan=job.plan, model=job.model, configured_level="none", rank=0, group=None
    )
    with caplog.at_level("WARNING", logger="trainspec.actuator"):
        state = save(job, tmp_path)
    assert state["actuator"]["error_feedback"] == {"parameters": 1}
    assert not [r for r in caplog.records if "not saved" in r.getMessage()]

    job.step(7)  # the actuated model's residual moves on; the restore takes it back
    job.state.restore(state, tmp_path)
    assert [torch.equal(a, b) for a, b in zip(
        other_hook.error_feedback().values(), other_residual.values(), strict=True
    )] == [True]  # fmt: skip


class _ComplexLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 16, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.cfloat) @ self.weight.T).abs()


def _int8_job(
    make: Callable[[], torch.nn.Module],
) -> tuple[DDP, CompressionHook, ActuatorState]:
    """A DDP model (made after seeding) at int8, and its actuator state."""
    torch.manual_seed(0)
    model = DDP(make())
    hook = CompressionHook("int8")
    hook.register(model)
    state = ActuatorState(hook=hook, plan=MicroBatchPlan(8, 1), model=model,
                          configured_level="int8", rank=0, group=None)  # fmt: skip
    return model, hook, state


def test_a_complex_parameter_s_error_feedback_comes_back(tmp_path: Path) -> None:
    """DDP sums a complex gradient as its real view: the residual holds two floats a value,
    and a restore that expected `p.numel()` refused a checkpoint it had written itself."""

    def job() -> tuple[DDP, CompressionHook, ActuatorState]:
        return _int8_job(_ComplexLinear)

    model, hook, state = job()
    for seed in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        model.zero_grad()
        model(x).pow(2).mean().backward()
    saved = hook.error_feedback()
    assert [t.numel() for t in saved.values()] == [2 * 4 * 16]
    snapshot, tensors = state.snapshot()
    (tmp_path / "extra").mkdir()
    rank_tensors.write(tmp_path, 0, tensors)
    resumed_model, resumed_hook, resumed_state = job()
    resumed_model.module.load_state_dict(model.module.state_dict())
    evidence = resumed_state.restore(json.loads(json.dumps(snapshot)), tmp_path)
    assert evidence["error_feedback"] == {"parameters": 1}
    restored = resumed_hook.error_feedback()
    assert [torch.equal(a, b) for a, b in zip(restored.values(), saved.values())] == [True]


def test_a_version_1_checkpoint_s_memory_order_residual_lands_on_the_same_values(
    tmp_path: Path,
) -> None:
    """Version 1 saved a non-contiguous parameter's residual in the bucket's memory order;
    version 2 saves logical order. A version 1 checkpoint read as logical order put 20 of 24
    values of a channels_last weight's residual on other elements, without a word."""

    def job() -> tuple[DDP, CompressionHook, ActuatorState]:
        return _int8_job(
            lambda: torch.nn.Conv2d(3, 2, 2, bias=False).to(memory_format=torch.channels_last)
        )

    model, hook, state = job()
    for seed in range(3):
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(seed))
        model.zero_grad()
        model(x.to(memory_format=torch.channels_last)).pow(2).mean().backward()
    logical = next(iter(hook.error_feedback().values()))
    weight = model.module.weight
    # What version 1 wrote: the same values in the weight's memory order (channels last).
    memory_order = logical.view(weight.shape).permute(0, 2, 3, 1).reshape(-1).clone()
    assert not torch.equal(memory_order, logical)
    snapshot, tensors = state.snapshot()
    snapshot = json.loads(json.dumps(snapshot))
    snapshot["actuator"]["version"] = 1
    (tmp_path / "extra").mkdir()
    rank_tensors.write(tmp_path, 0, {name: memory_order for name in tensors})
    resumed_model, resumed_hook, resumed_state = job()
    resumed_model.module.load_state_dict(model.module.state_dict())
    assert resumed_state.restore(snapshot, tmp_path)["error_feedback"] == {"parameters": 1}
    assert torch.equal(next(iter(resumed_hook.error_feedback().values())), logical)


def test_with_the_actuator_off_the_checkpoint_s_plan_is_not_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """QA bug 6: resumed with TRAINSPEC_ACTUATOR=off, the job kept the restored shares
    [14, 2] and micro-batch limit to its end, with nothing left to move them back. Off, it
    runs as a fresh job with the actuator off would: configured level and micro-batch, equal
    shares; the sampler's place in the epoch and the error feedback still come back."""
    from trainspec.data import ShareBatchSampler

    job = moved_job()
    sampler = ShareBatchSampler(1000, 16, rank=0, world_size=2)
    sampler.set_shares([14, 2])
    for _ in range(3):
        sampler.next_step()
    state = save(job, tmp_path)
    resumed = Job("none")
    resumed.model.module.load_state_dict(job.model.module.state_dict())
    own = ShareBatchSampler(1000, 16, rank=0, world_size=2)
    own.load_state_dict(sampler.state_dict())  # what the checkpointer restores
    resumed.state.switched_off, resumed.state.sampler = True, own
    with caplog.at_level("WARNING", logger="trainspec.actuator"):
        evidence = resumed.state.restore(state, tmp_path)
    assert own.shares == (8, 8) and (own.epoch, own.position) == (0, 48)
    assert resumed.hook.shares == (8, 16)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    assert own.next_step().indices == perm[48:56]  # on from the checkpoint: none twice, none lost
    assert (resumed.hook.next_level, resumed.plan.limit, resumed.plan.oom_at) == ("none", 8, 0)
    assert evidence["restored"] is False and evidence["shares"]["saved"] == [14, 2]
    assert evidence["error_feedback"] == {"parameters": 1}  # owed gradient, not a plan
    (warning,) = [r for r in caplog.records if "actuator is off" in r.getMessage()]
    assert "[14, 2]" in warning.getMessage() and "int8" in warning.getMessage()
    # the error feedback still makes the next update the uninterrupted job's at level none
    job.hook.set_level("none", at_step=job.hook.step)
    job.hook.set_shares(8, 16)
    assert torch.equal(resumed.step(5), job.step(5))


def test_for_session_reads_the_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from trainspec.config import TrainspecConfig

    session = SimpleNamespace(
        config=TrainspecConfig(), hook=None, groups=None, identity=SimpleNamespace(rank=0)
    )
    plan = MicroBatchPlan(8, 1)
    monkeypatch.setenv("TRAINSPEC_ACTUATOR", "on")
    assert not ActuatorState.for_session(session, plan, None).switched_off
    monkeypatch.setenv("TRAINSPEC_ACTUATOR", "off")
    assert ActuatorState.for_session(session, plan, None, sampler="s").switched_off
    monkeypatch.setenv("TRAINSPEC_ACTUATOR", "on")
    session.config.actuator.enabled = False
    assert ActuatorState.for_session(session, plan, None).switched_off
