"""One save per step, checkpoints of a diverged state marked and loaded last, and several
optimizers in one checkpoint (QA B1, B2, B5), on a one-rank gloo group."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trainspec.runtime.checkpoint as checkpoint_module
from tests.unit.test_checkpoint import _Job, _params
from trainspec.runtime.checkpoint import Checkpointer
from trainspec.runtime.checkpoint_layout import COMMIT_NAME, committed_newest_first

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


@pytest.fixture
def dcp_saves(monkeypatch) -> list[str]:
    """The directories dcp.save is called for, in order."""
    calls: list[str] = []
    real = checkpoint_module.dcp.save

    def counting(state, *args, checkpoint_id=None, **kwargs):
        calls.append(str(checkpoint_id))
        return real(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", counting)
    return calls


@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_already_committed_is_not_written_again(
    tmp_path: Path, dcp_saves: list[str], async_save: bool
) -> None:
    """The preemption save of a step the controller had just saved wrote the committed
    directory a second time; a crash part-way left no loadable checkpoint (QA B2)."""
    events: list[tuple[str, str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=async_save, on_event=lambda *e: events.append(e))
    job = _Job()
    job.step()
    job.save(ck, 6, reason="first")
    first = ck.wait() if async_save else ck.last_saved
    assert first is not None and ck.covers(6) and not ck.covers(7)
    marker = (Path(first.path) / COMMIT_NAME).read_bytes()
    assert job.save(ck, 6, reason="preemption") is first
    assert dcp_saves == [first.path] and [r for _, r, _ in events] == ["first"]
    assert (Path(first.path) / COMMIT_NAME).read_bytes() == marker
    ck.close()


def test_a_step_still_being_saved_is_waited_for_not_saved_again(
    tmp_path: Path, dcp_saves: list[str]
) -> None:
    ck = Checkpointer(tmp_path, async_save=True)
    job = _Job()
    job.step()
    assert job.save(ck, 6) is None and ck.covers(6)  # in flight
    record = job.save(ck, 6, reason="preemption", block=True)
    assert record is not None and record.step == 6 and record.reason == "periodic"
    assert len(dcp_saves) == 1
    ck.close()


def test_a_step_whose_save_failed_in_flight_is_saved_again(tmp_path: Path, monkeypatch) -> None:
    """One save per step means one that commits: a failed one is no reason to skip it."""
    real = checkpoint_module.dcp.save
    tries: list[str] = []

    def fails_once(state, *args, checkpoint_id=None, **kwargs):
        tries.append(str(checkpoint_id))
        if len(tries) == 1:
            raise OSError(28, "No space left on device")
        return real(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", fails_once)
    ck = Checkpointer(tmp_path, async_save=True)
    job = _Job()
    job.step()
    assert job.save(ck, 6) is None and ck.covers(6)
    started = ck.saves_started
    record = job.save(ck, 6, reason="preemption", block=True)
    assert record is not None and record.reason == "preemption" and len(tries) == 2
    assert ck.saves_started == started + 1
    assert [c.step for c in committed_newest_first(tmp_path)] == [6]
    ck.close()


def test_no_save_writes_into_a_committed_directory(tmp_path: Path, dcp_saves: list[str]) -> None:
    """Whatever lost track of it (here: the record), a committed directory is refused, on
    every rank alike, and the committed checkpoint still loads."""
    events: list[tuple[str, str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=False, on_event=lambda *e: events.append(e))
    job = _Job()
    job.step()
    first = job.save(ck, 6)
    marker = (Path(first.path) / COMMIT_NAME).read_bytes()
    ck.last_saved = None
    assert job.save(ck, 6) is None
    failed = [e for _, r, e in events if r == "save_failed"]
    assert len(failed) == 1 and "already committed" in failed[0]["error"]
    assert dcp_saves == [first.path]
    assert (Path(first.path) / COMMIT_NAME).read_bytes() == marker
    assert _Job(seed=4).load(ck).step == 6
    ck.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_checkpoint_of_non_finite_weights_is_marked_and_loaded_last(
    tmp_path: Path, async_save: bool
) -> None:
    """A diverged job's checkpoints (NaN weights) were loaded as the newest: the resumed job
    was NaN from its first step (QA B1)."""
    ck = Checkpointer(tmp_path, async_save=async_save, keep_last=1)
    job = _Job()
    job.model.register_buffer("mask", torch.full((3,), -torch.inf))  # no divergence: a buffer
    job.step()
    good = _params(job.model)
    job.save(ck, 1, block=True)
    assert ck.last_saved.finite
    with torch.no_grad():
        next(job.model.parameters())[0, 0] = torch.nan
    job.save(ck, 2, anomaly="loss spike since step 2", block=True)
    assert not ck.last_saved.finite and ck.last_saved.anomaly == "loss spike since step 2"
    newest = committed_newest_first(tmp_path)
    assert [c.step for c in newest] == [2, 1]  # keep_last=1 did not drop the finite one
    manifest = json.loads(newest[0].commit_path.read_text())
    assert (manifest["finite"], manifest["anomaly"]) == (False, "loss spike since step 2")
    fresh = _Job(seed=5)
    fresh.model.register_buffer("mask", torch.zeros(3))
    loaded = fresh.load(ck)
    assert loaded.step == 1 and "non-finite weights" in loaded.fallbacks[0]
    for got, want in zip(_params(fresh.model), good, strict=True):
        assert torch.equal(got, want)
    ck.close()


class _TwoOptimizers:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        self.opts = [
            torch.optim.AdamW(self.model[0].parameters(), lr=1e-2),
            torch.optim.SGD(self.model[1].parameters(), lr=1e-2, momentum=0.9),
        ]

    def step(self, x: torch.Tensor | None = None) -> None:
        loss = self.model(torch.randn(6, 4) if x is None else x).pow(2).mean()
        for opt in self.opts:
            opt.zero_grad()
        loss.backward()
        for opt in self.opts:
            opt.step()


def _optim_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state_dict()["state"].values() for v in state.values()]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_list_of_optimizers_is_saved_and_each_gets_its_own_state_back(
    tmp_path: Path, async_save: bool
) -> None:
    """`actuate(optimizer=[o1, o2])` was accepted, then every checkpoint failed with
    "'list' object has no attribute 'state_dict'" (QA B5)."""
    ck = Checkpointer(tmp_path, async_save=async_save)
    job = _TwoOptimizers(0)
    for _ in range(2):
        job.step()
    record = ck.save(2, model=job.model, optimizer=job.opts, block=True)
    assert record is not None and record.committed
    fresh = _TwoOptimizers(7)
    assert ck.load_latest(model=fresh.model, optimizer=list(fresh.opts)).step == 2
    for mine, theirs in zip(fresh.opts, job.opts, strict=True):
        assert len(_optim_tensors(mine)) == len(_optim_tensors(theirs)) > 0
        for got, want in zip(_optim_tensors(mine), _optim_tensors(theirs), strict=True):
            assert torch.equal(got, want)
    x = torch.randn(6, 4)
    job.step(x)
    fresh.step(x)
    for got, want in zip(_params(fresh.model), _params(job.model), strict=True):
        assert torch.equal(got, want)
    ck.close()


def _session(tmp_path: Path, events: list) -> SimpleNamespace:
    from trainspec.config import load_config
    from trainspec.runtime.groups import SideGroups
    from trainspec.runtime.identity import RankIdentity

    config = load_config(overrides={"actuator": {"enabled": False}}, environ={})
    return SimpleNamespace(
        identity=RankIdentity(0, 0, 1, "host"), config=config, hook=None,
        groups=SideGroups(probe=None, control=None), operator_actions=False,
        event=lambda *a, **k: events.append((a, k)), boundary_hooks=[], record_listeners=[],
    )  # fmt: skip


@pytest.mark.parametrize("bad", ["adam", [], [object()], None.__class__])
def test_actuate_names_an_optimizer_it_cannot_checkpoint(tmp_path: Path, bad) -> None:
    from trainspec.runtime.actuation import attach

    with pytest.raises(TypeError, match="optimizer= must be a torch.optim.Optimizer or a"):
        attach(_session(tmp_path, []), dataset_len=8, global_batch=2, optimizer=bad,
               model=torch.nn.Linear(2, 1), checkpoint_dir=str(tmp_path / "ck"))  # fmt: skip


def test_the_preemption_save_of_a_step_just_saved_is_not_made_again(
    tmp_path: Path, dcp_saves: list[str]
) -> None:
    """`should_stop` saved the step the controller had saved at the same boundary: two
    `saved` events for one step and a second write into the committed directory (QA B2)."""
    from trainspec.runtime.actuation import attach

    events: list = []
    job = _Job()
    act = attach(_session(tmp_path, events), dataset_len=8, global_batch=2, model=job.model,
                 optimizer=job.opt, checkpoint_dir=str(tmp_path / "ck"))  # fmt: skip
    act.preemption.close()
    act.preemption = SimpleNamespace(should_stop=lambda: True, disarm=lambda: None,
                                     close=lambda: None)  # fmt: skip
    try:
        job.step()
        act.save_checkpoint(6, "first checkpoint, to measure its cost")  # the controller's
        assert act.should_stop(6) is True
    finally:
        act.close()
    saved = [a for a, _ in events if a[:2] == ("checkpoint", "saved")]
    stop = [k["evidence"] for a, k in events if a[:2] == ("action", "checkpoint")]
    assert len(dcp_saves) == 1 and len(saved) == 1
    assert stop == [{"step": 6, "already_saved": True}]
    assert [c.step for c in committed_newest_first(tmp_path / "ck")] == [6]


def test_the_next_checkpoint_tried_is_said_as_older_or_newer():
    """After a finite checkpoint failed to load, the next one tried may be a newer,
    non-finite one (`load_order`): it was said as "trying an older checkpoint" (review)."""
    from trainspec.runtime.checkpoint import _next_tried

    order = ["/c/step_000000006_aa", "/c/step_000000016_bb"]
    assert _next_tried(order, 1, 6) == "trying a newer checkpoint"
    assert _next_tried(order[::-1], 1, 16) == "trying an older checkpoint"
    assert _next_tried(order, 2, 16) == "no older checkpoint left"
