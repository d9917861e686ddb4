"""Checkpointer on a one-rank gloo group: round trip, atomicity, fallback and typed errors."""

from __future__ import annotations

import json
import random
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from trainspec.data import ShareBatchSampler
from trainspec.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    WorldSizeMismatchError,
)
from trainspec.runtime.checkpoint_layout import COMMIT_NAME, committed_newest_first

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


class _Job:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.sampler = ShareBatchSampler(40, 8, rank=0, world_size=1, seed=0)

    def step(self) -> None:
        batch = self.sampler.next_step()
        x = torch.randn(len(batch.indices), 8)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()

    def save(self, ck: Checkpointer, step: int, **kw):
        return ck.save(
            step,
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            sampler=self.sampler,
            trainspec_state={"step": step},
            **kw,
        )

    def load(self, ck: Checkpointer):
        return ck.load_latest(
            model=self.model, optimizer=self.opt, scheduler=self.sched, sampler=self.sampler
        )


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_continues_exactly_where_the_save_left(tmp_path: Path, async_save: bool) -> None:
    events: list[tuple[str, str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=async_save, on_event=lambda *e: events.append(e))
    job = _Job()
    for _step in range(1, 4):
        job.step()
    random.seed(5)
    np.random.seed(5)
    job.save(ck, 3)
    record = ck.wait() if async_save else ck.last_saved
    assert record is not None and record.committed and record.bytes > 0 and record.step == 3
    assert 0 <= record.stall_s <= record.duration_s
    # What the uninterrupted job does next (step() draws from torch's RNG, not python's or numpy's):
    expected_draws = (random.random(), np.random.rand())
    job.step()
    job.step()
    expected_params = _params(job.model)

    resumed = _Job(seed=99)  # different init: everything must come from the checkpoint
    loaded = resumed.load(ck)
    assert loaded is not None and loaded.step == 3 and loaded.trainspec_state == {"step": 3}
    assert (random.random(), np.random.rand()) == expected_draws
    assert resumed.sampler.state_dict() == job.sampler.state_dict() | {"position": 24, "epoch": 0}
    resumed.step()
    resumed.step()
    for got, want in zip(_params(resumed.model), expected_params, strict=True):
        assert torch.equal(got, want)
    assert resumed.sched.state_dict() == job.sched.state_dict()
    kinds = {(k, r) for k, r, _ in events}
    assert ("checkpoint", "periodic") in kinds and ("checkpoint", "loaded") in kinds
    ck.close()


def test_async_save_snapshots_state_before_returning(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, async_save=True)
    job = _Job()
    job.step()
    before = _params(job.model)
    job.save(ck, 1)
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)
    ck.wait()
    fresh = _Job(seed=3)
    fresh.load(ck)
    for got, want in zip(_params(fresh.model), before, strict=True):
        assert torch.equal(got, want)
    ck.close()


def test_retention_keeps_the_newest_k(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep_last=2, async_save=False)
    job = _Job()
    for step in range(1, 5):
        job.step()
        job.save(ck, step)
    assert [c.step for c in committed_newest_first(tmp_path)] == [4, 3]
    assert len(list(tmp_path.iterdir())) == 2
    ck.close()


def _three_checkpoints(tmp_path: Path, events: list) -> tuple[Checkpointer, _Job]:
    ck = Checkpointer(tmp_path, async_save=False, on_event=lambda *e: events.append(e))
    job = _Job()
    for step in range(1, 4):
        job.step()
        job.save(ck, step)
    return ck, job


def test_uncommitted_newest_is_ignored(tmp_path: Path) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    (committed_newest_first(tmp_path)[0].commit_path).unlink()  # as if killed before the commit
    loaded = _Job(seed=1).load(ck)
    assert loaded is not None and loaded.step == 2 and loaded.fallbacks == []
    ck.close()


def _shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_damaged_newest_falls_back_to_previous_and_says_why(tmp_path: Path, damage: str) -> None:
    events: list = []
    ck, _ = _three_checkpoints(tmp_path, events)
    newest = committed_newest_first(tmp_path)[0].path
    shard = _shard(newest)
    if damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    loaded = _Job(seed=1).load(ck)
    assert loaded is not None and loaded.step == 2
    assert len(loaded.fallbacks) == 1
    assert ("corrupt" if damage == "corrupt" else "missing file") in loaded.fallbacks[0]
    assert any(r == "fallback" for _, r, _ in events)
    ck.close()


def test_a_checkpoint_loaded_past_is_set_aside_and_retention_keeps_the_good_ones(
    tmp_path: Path,
) -> None:
    """Counted as committed, a damaged newest checkpoint was kept by retention while the
    resumed job's good ones were deleted: keep_last=1 left only the damaged one, and the next
    restart had nothing to load (a recovery QA run)."""
    ck, job = _three_checkpoints(tmp_path, [])
    job.save(ck, 5)
    ck.close()
    damaged = committed_newest_first(tmp_path)[0].path  # step 5
    _shard(damaged).write_bytes(b"garbage")
    ck = Checkpointer(tmp_path, async_save=False, keep_last=1)
    job = _Job(seed=1)
    assert job.load(ck).step == 3
    assert not damaged.exists() and (tmp_path / f"damaged-{damaged.name}").is_dir()
    job.step()
    job.save(ck, 4)  # the resumed job's step 4: retention keeps it, not the damaged step 5
    ck.close()
    ck = Checkpointer(tmp_path, async_save=False)
    loaded = _Job(seed=2).load(ck)
    assert loaded is not None and loaded.step == 4 and loaded.fallbacks == []
    assert [c.step for c in committed_newest_first(tmp_path)] == [4]
    ck.close()


def test_nothing_loadable_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    for c in committed_newest_first(tmp_path):
        _shard(c.path).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="could be loaded"):
        _Job(seed=1).load(ck)
    assert len(committed_newest_first(tmp_path)) == 3  # none set aside: a restart finds them
    ck.close()


def test_other_world_size_is_refused(tmp_path: Path) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    commit = committed_newest_first(tmp_path)[0].commit_path
    manifest = json.loads(commit.read_text())
    manifest["world_size"] = 4
    commit.write_text(json.dumps(manifest))
    with pytest.raises(WorldSizeMismatchError, match="written by 4 ranks, this job has 1"):
        _Job(seed=1).load(ck)
    ck.close()


def test_unreadable_commit_marker_falls_back(tmp_path: Path) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    (committed_newest_first(tmp_path)[0].path / COMMIT_NAME).write_text("{not json")
    loaded = _Job(seed=1).load(ck)
    assert (
        loaded is not None
        and loaded.step == 2
        and "unreadable commit marker" in loaded.fallbacks[0]
    )
    ck.close()


def test_empty_root_is_a_fresh_start_and_a_raising_callback_is_contained(tmp_path: Path) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("sink down")

    ck = Checkpointer(tmp_path, on_event=broken)
    job = _Job()
    assert job.load(ck) is None
    job.step()
    assert job.save(ck, 1, block=True) is not None
    ck.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    events: list[tuple[str, dict]] = []
    ck = Checkpointer(tmp_path, on_event=lambda kind, reason, ev: events.append((reason, ev)))
    job = _Job()
    # State that is not JSON fails the save, reported, not raised into the training loop
    # (on several ranks a raise here would leave the others in the save's collectives).
    for async_save in (True, False):
        ck.async_save = async_save
        bad = {"x": object()}
        assert (
            ck.save(1, model=job.model, optimizer=job.opt, trainspec_state=bad, block=True) is None
        )
        reason, evidence = events.pop()
        assert reason == "save_failed" and "JSON" in evidence["error"]
    assert committed_newest_first(tmp_path) == []
    ck.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_dcp_write_failure_is_reported_not_raised(
    tmp_path: Path, monkeypatch, async_save
) -> None:
    """dcp raises CheckpointException, a BaseException: `except Exception` let it out of
    save() and it ended training on every rank (a full disk, say)."""
    from torch.distributed.checkpoint.api import CheckpointException

    import trainspec.runtime.checkpoint as checkpoint

    def full_disk(*args, **kwargs):
        failure = (OSError(28, "No space left on device"), traceback.StackSummary())
        raise CheckpointException("write failed", {0: failure})

    events: list[tuple[str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=async_save,
                      on_event=lambda kind, reason, ev: events.append((reason, ev)))  # fmt: skip
    job = _Job()
    job.step()
    assert job.save(ck, 1, block=True) is not None
    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    assert job.save(ck, 2, block=True) is None
    assert events[-1][0] == "save_failed" and "No space left" in events[-1][1]["error"]
    monkeypatch.undo()
    assert [c.step for c in committed_newest_first(tmp_path)] == [1]
    ck.close()


def test_a_dcp_read_failure_falls_back(tmp_path: Path, monkeypatch) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    import trainspec.runtime.checkpoint as checkpoint

    ck, _ = _three_checkpoints(tmp_path, [])
    real_load = checkpoint.dcp.load
    calls = []

    def load_once_failing(*args, **kwargs):
        calls.append(kwargs["checkpoint_id"])
        if len(calls) == 1:
            failure = (RuntimeError("size mismatch"), traceback.StackSummary())
            raise CheckpointException("read failed", {0: failure})
        return real_load(*args, **kwargs)

    monkeypatch.setattr(checkpoint.dcp, "load", load_once_failing)
    loaded = _Job(seed=1).load(ck)
    assert loaded is not None and loaded.step == 2 and "dcp load failed" in loaded.fallbacks[0]
    # A read that failed for a reason of the moment does not set the checkpoint aside: its
    # files match the manifest, and it may load next time (review).
    assert [c.step for c in committed_newest_first(tmp_path)] == [3, 2, 1]
    ck.close()


def test_a_checkpointer_without_a_process_group_in_a_job_of_several_ranks_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    """Alone, each rank would save as rank 0 of 1 into one directory (review)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match="several ranks"):
        Checkpointer(tmp_path)


def test_a_commit_that_cannot_be_written_fails_the_save_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 skipped the broadcast when its commit raised: the other ranks waited out the
    group's timeout and the group was dead for every later save."""
    import trainspec.runtime.checkpoint_layout as layout

    events: list[tuple[str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=False,
                      on_event=lambda kind, reason, ev: events.append((reason, ev)))  # fmt: skip
    job = _Job()
    real = layout.write_commit
    monkeypatch.setattr(
        layout, "write_commit", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO"))
    )
    assert job.save(ck, 1) is None
    assert events[-1][0] == "save_failed" and "commit marker not written" in events[-1][1]["error"]
    monkeypatch.setattr(layout, "write_commit", real)
    monkeypatch.setattr(layout, "apply_retention", lambda *a: (_ for _ in ()).throw(OSError("x")))
    assert job.save(ck, 2) is not None  # retention failing leaves the checkpoint committed
    assert [c.step for c in committed_newest_first(tmp_path)] == [2]
    ck.close()


@pytest.mark.parametrize(
    ("manifest", "words"),
    [
        ("[1, 2]", "not a JSON object"),
        ("null", "not a JSON object"),
        ('{"format": 1, "files": {"extra/rank0.json": {"bytes": 3}}}', "integer size and crc32"),
        ('{"format": 1, "files": {"extra/rank0.json": [1, 2]}}', "integer size and crc32"),
    ],
)
def test_a_commit_marker_of_the_wrong_shape_falls_back(tmp_path: Path, manifest, words) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    (committed_newest_first(tmp_path)[0].path / COMMIT_NAME).write_text(manifest)
    loaded = _Job(seed=1).load(ck)
    assert loaded is not None and loaded.step == 2 and words in loaded.fallbacks[0]
    ck.close()


def test_close_twice_and_use_after_close(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    job = _Job()
    ck.close()
    ck.close()  # a second close does nothing (it raised: the group was already destroyed)
    with pytest.raises(CheckpointError, match="save after close"):
        job.save(ck, 1, block=True)  # it hung: the closed worker never ran the job
    with pytest.raises(CheckpointError, match="load_latest after close"):
        job.load(ck)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"keep_last": 2.0}, TypeError, "keep_last must be a whole number"),
        ({"keep_last": 0}, ValueError, "keep_last must be at least 1"),
        ({"timeout_s": 0}, ValueError, "timeout_s must be a positive"),
    ],
)
def test_bad_construction_is_refused_by_name(tmp_path: Path, kwargs, error, words) -> None:
    with pytest.raises(error, match=words):
        Checkpointer(tmp_path, **kwargs)


@pytest.mark.parametrize(("step", "error"), [(-1, ValueError), (1.5, TypeError), ("3", TypeError)])
def test_a_bad_step_is_refused_before_anything_is_written(tmp_path: Path, step, error) -> None:
    ck = Checkpointer(tmp_path)
    with pytest.raises(error, match="step"):
        _Job().save(ck, step, block=True)
    assert list(tmp_path.iterdir()) == []
    ck.close()


def test_the_fallback_warning_says_when_no_older_checkpoint_is_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every checkpoint damaged: the last one's warning said "trying an older checkpoint",
    and then the job stopped, as there was none."""
    ck, _ = _three_checkpoints(tmp_path, [])
    for c in committed_newest_first(tmp_path):
        _shard(c.path).write_bytes(b"garbage")
    with caplog.at_level("WARNING"), pytest.raises(CheckpointError):
        _Job(seed=1).load(ck)
    said = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage()]
    tails = [m.rsplit("; ", 1)[-1] for m in said if m.startswith("trainspec: checkpoint ")]
    assert tails == ["trying an older checkpoint"] * 2 + ["no older checkpoint left"], said
    ck.close()
