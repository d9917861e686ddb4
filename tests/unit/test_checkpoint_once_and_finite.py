"""One save per step (and one more of a step retraced after a rollback), checkpoints of a
diverged state marked and loaded last, and several optimizers in one checkpoint (QA B1, B2,
B5), on a one-rank gloo group."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trainspec.runtime.checkpoint as checkpoint_module
from tests.unit.test_checkpoint import _Job, _params
from trainspec.runtime import checkpoint_layout as layout
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


def test_a_step_retraced_after_a_rollback_is_saved_again_and_loaded_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a load of an older checkpoint than the job's newest, the steps the job retraces
    were refused: the save of one it had saved before returned the old record (or failed as
    "already committed"), and a restart lost the retraced work. Each load starts a new
    directory nonce: the retraced step is a directory of its own, loaded before the old one."""
    ck = Checkpointer(tmp_path, async_save=True, keep_last=3)
    job = _Job()
    job.step()
    job.save(ck, 2, block=True)
    job.step()
    first = job.save(ck, 4, block=True)
    assert first is not None
    abandoned = _params(job.model)
    real, failed = checkpoint_module.dcp.load, []

    def fails_once(state, *args, checkpoint_id=None, **kwargs):
        if checkpoint_id == first.path and not failed:  # a read that fails for the moment
            failed.append(checkpoint_id)
            raise OSError(5, "Input/output error")
        return real(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "load", fails_once)
    assert job.load(ck).step == 2  # the rollback
    job.step()
    job.step()  # step 4 again, another state: two steps where the first trajectory took one
    retraced = job.save(ck, 4, block=True)
    assert retraced is not None and retraced.committed and retraced.path != first.path
    order = committed_newest_first(tmp_path)
    assert [c.step for c in order] == [4, 4, 2]
    assert [str(c.path) for c in order[:2]] == [retraced.path, first.path]
    assert ck.covers(4)
    want = _params(job.model)
    assert not all(torch.equal(a, b) for a, b in zip(want, abandoned, strict=True))
    ck.close()
    other = Checkpointer(tmp_path, async_save=False)
    fresh = _Job(seed=3)
    loaded = fresh.load(other)
    assert loaded is not None and loaded.path == retraced.path
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh.model), want, strict=True))
    other.close()


@pytest.mark.parametrize("nonces", [("ff00", "00ff"), ("00ff", "ff00")])
def test_saves_of_one_step_with_the_same_mtime_are_ordered_by_their_manifests(
    tmp_path: Path, nonces: tuple[str, str]
) -> None:
    """A file system with coarse timestamps gives two saves of one step the same mtime: the
    manifest's own clock reading says which came last, whatever the names."""
    made = []
    for nonce in nonces:
        path = tmp_path / layout.dir_name(4, nonce)
        (path / layout.EXTRA_DIR).mkdir(parents=True)
        layout.write_commit(path, step=4, world_size=1, reason="periodic")
        made.append(path)
    for path in made:
        os.utime(path / COMMIT_NAME, (1_000_000.0, 1_000_000.0))
    assert [c.path for c in layout.list_checkpoints(tmp_path)] == made


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
    assert loaded.step == 1 and len(loaded.fallbacks) == 1
    for got, want in zip(_params(fresh.model), good, strict=True):
        assert torch.equal(got, want)
    ck.close()


def test_the_note_on_a_non_finite_checkpoint_passed_over_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a person reads in the `resumed` event's fallbacks and in rank 0's warning when
    loading passes over a newer checkpoint whose state is not finite."""
    ck = Checkpointer(tmp_path, async_save=False)
    job = _Job()
    job.step()
    job.save(ck, 1)
    with torch.no_grad():
        next(job.model.parameters())[0, 0] = torch.nan
    diverged = job.save(ck, 2)
    assert diverged is not None and not diverged.finite
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime.checkpoint"):
        loaded = _Job(seed=5).load(ck)
    note = (
        f"checkpoint {diverged.path}: non-finite state saved (a NaN, or an infinite weight or "
        "optimizer state: a diverged state); tried after the finite ones"
    )
    assert loaded is not None and loaded.step == 1 and loaded.fallbacks == [note]
    assert f"trainspec: {note}" in caplog.messages
    ck.close()


def _save_marked(tmp_path: Path, damage, frozen: bool) -> tuple[bool, bool]:
    """(finite, finite) as the async and the sync save record a `_Job` after `damage(job)`;
    `frozen`: the first layer's bias is frozen (held by no optimizer)."""
    marks = []
    for async_save in (True, False):
        ck = Checkpointer(tmp_path / str(async_save), async_save=async_save)
        job = _Job()
        if frozen:
            job.model[0].bias.requires_grad_(False)
            job.opt = torch.optim.AdamW([p for p in job.model.parameters() if p.requires_grad])
            job.sched = torch.optim.lr_scheduler.StepLR(job.opt, step_size=2)
        job.step()
        with torch.no_grad():
            damage(job)
        record = job.save(ck, 1, block=True)
        assert record is not None
        marks.append(record.finite)
        ck.close()
    return marks[0], marks[1]


def _first_state(job: _Job, key: str) -> torch.Tensor:
    return next(iter(job.opt.state.values()))[key]


@pytest.mark.parametrize(
    ("damage", "frozen", "finite"),
    [
        # NaN anywhere is a diverged state: a buffer (a running mean), a frozen parameter
        (lambda j: j.model.register_buffer("running", torch.tensor([0.0, torch.nan])), 0, False),
        (lambda j: j.model[0].bias.view(-1)[0].fill_(torch.nan), 1, False),
        (lambda j: j.model[2].weight.view(-1)[0].fill_(torch.nan), 0, False),
        (lambda j: _first_state(j, "exp_avg").view(-1)[0].fill_(torch.nan), 0, False),
        # an infinity only where training writes it: a trained weight, the optimizer's state
        (lambda j: j.model[2].weight.view(-1)[0].fill_(torch.inf), 0, False),
        (lambda j: _first_state(j, "exp_avg_sq").view(-1)[0].fill_(torch.inf), 0, False),
        # a mask holds -inf by design, as a buffer or as a parameter no optimizer holds
        (lambda j: j.model.register_buffer("mask", torch.tensor([0.0, -torch.inf])), 0, True),
        (lambda j: j.model[0].bias.view(-1)[0].fill_(-torch.inf), 1, True),
    ],
    ids=[
        "nan-buffer",
        "nan-frozen-param",
        "nan-param",
        "nan-optim",
        "inf-param",
        "inf-optim",
        "inf-mask-buffer",
        "inf-frozen-param",
    ],
)
def test_every_floating_tensor_is_read_for_nan_and_trained_ones_for_inf(
    tmp_path: Path, damage, frozen: int, finite: bool
) -> None:
    """Only parameters an optimizer updates and the optimizer's state were read: a NaN in a
    BatchNorm running mean or a frozen embedding was saved as finite, counted toward
    `keep_last`, and loaded first."""
    assert _save_marked(tmp_path, damage, bool(frozen)) == (finite, finite)


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
