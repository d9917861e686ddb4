"""The on-disk contract without any process group: commit marker, verification, retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainspec.runtime import checkpoint_layout as layout


def _make(
    root: Path, step: int, nonce: str = "ab12", *, commit: bool = True, world: int = 1
) -> Path:
    d = root / layout.dir_name(step, nonce)
    (d / layout.EXTRA_DIR).mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (d / ".metadata").write_bytes(b"meta")
    for rank in range(world):
        layout.extra_path(d, rank).write_text("{}")
    (d / ".metadata.tmp123").write_bytes(b"half-written")  # never part of the manifest
    if commit:
        layout.write_commit(d, step=step, world_size=world, reason="test")
    return d


def test_commit_manifest_lists_finished_files_only(tmp_path: Path) -> None:
    d = _make(tmp_path, 5)
    files = json.loads((d / layout.COMMIT_NAME).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "extra/rank0.json"]
    assert layout.verify(layout.list_checkpoints(tmp_path)[0], world_size=1)["step"] == 5


def test_listing_orders_by_step_and_skips_uncommitted(tmp_path: Path) -> None:
    _make(tmp_path, 10)
    _make(tmp_path, 5)
    _make(tmp_path, 15, commit=False)
    (tmp_path / "not-a-checkpoint").mkdir()
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [5, 10, 15]
    assert [c.step for c in layout.committed_newest_first(tmp_path)] == [10, 5]


def test_retention_drops_old_commits_and_old_debris_but_not_newer_work(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        _make(tmp_path, step)
    _make(tmp_path, 12, "dead", commit=False)  # a crashed attempt's leftovers
    _make(tmp_path, 25, commit=False)  # a save that may still be in flight
    removed = layout.apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == sorted(
        layout.dir_name(s, n) for s, n in ((5, "ab12"), (10, "ab12"), (12, "dead"))
    )
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [15, 20, 25]


def test_retention_drops_a_set_aside_checkpoint_once_keep_last_newer_ones_exist(
    tmp_path: Path,
) -> None:
    """Set-aside (damaged) checkpoints were never removed: a job that kept meeting damage
    kept every one of them, full-size, for ever."""
    for step in (5, 10):
        _make(tmp_path, step)
    aside = layout.set_aside(layout.list_checkpoints(tmp_path)[-1])  # step 10 found damaged
    assert aside.name == f"damaged-{layout.dir_name(10, 'ab12')}"
    _make(tmp_path, 10, "cd34")  # the resumed job's checkpoints
    layout.apply_retention(tmp_path, keep_last=2)
    assert aside.is_dir()  # only one newer: kept for a person to look at
    _make(tmp_path, 15, "cd34")
    assert aside.is_dir()  # the step-10 save of the resumed job is not newer than it
    layout.apply_retention(tmp_path, keep_last=2)
    assert aside.is_dir()
    _make(tmp_path, 20, "cd34")
    removed = layout.apply_retention(tmp_path, keep_last=2)
    assert aside in removed and not aside.exists()
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [15, 20]


def test_verify_names_the_problem(tmp_path: Path) -> None:
    d = _make(tmp_path, 5, world=2)
    c = layout.list_checkpoints(tmp_path)[0]
    with pytest.raises(layout.WorldSizeMismatchError, match="written by 2 ranks, this job has 4"):
        layout.verify(c, world_size=4)
    layout.extra_path(d, 1).unlink()
    with pytest.raises(layout.CorruptCheckpointError, match="missing file extra/rank1.json"):
        layout.verify(c, world_size=2)


def test_write_atomic_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    layout.write_atomic(target, b"{}")
    layout.write_atomic(target, b"[1]")
    assert target.read_bytes() == b"[1]" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_retention_drops_a_killed_saves_directory_of_the_step_committed_again(
    tmp_path: Path,
) -> None:
    """kill -9 during the first save left `step_6_<dead>` uncommitted; the restarted job
    saved step 6 again under its own nonce. The dead one was kept (it was not older than the
    newest commit) by every later save of that step, piling up with each restart."""
    _make(tmp_path, 6, "dead", commit=False)
    _make(tmp_path, 9, "dead", commit=False)  # newer than any commit: left for now
    _make(tmp_path, 6, "beef")
    removed = layout.apply_retention(tmp_path, keep_last=3)
    assert [p.name for p in removed] == [layout.dir_name(6, "dead")]
    assert [(c.step, c.nonce) for c in layout.list_checkpoints(tmp_path)] == [
        (6, "beef"),
        (9, "dead"),
    ]
    _make(tmp_path, 9, "beef")  # once this job commits that step, its debris goes too
    assert [p.name for p in layout.apply_retention(tmp_path, keep_last=3)] == [
        layout.dir_name(9, "dead")
    ]
    assert all(c.is_committed() for c in layout.list_checkpoints(tmp_path))


def _mark(d: Path, *, finite: bool = True, anomaly: str | None = None) -> Path:
    step = int(d.name.split("_")[1])
    layout.write_commit(d, step=step, world_size=1, reason="test", finite=finite, anomaly=anomaly)
    return d


def test_retention_keeps_the_last_checkpoint_taken_before_an_anomaly(tmp_path: Path) -> None:
    """A loss spike that lasts: every checkpoint after the good one is taken in the anomaly;
    keep_last of them rotated the good one out (QA B1, spk)."""
    _make(tmp_path, 6)
    for step in (16, 21, 26, 31):
        _mark(_make(tmp_path, step), anomaly="loss spike since step 16")
        layout.apply_retention(tmp_path, keep_last=2)
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [6, 26, 31]
    assert [layout.marks(c) for c in layout.list_checkpoints(tmp_path)] == [
        (True, None), (True, "loss spike since step 16"), (True, "loss spike since step 16")
    ]  # fmt: skip
    _make(tmp_path, 36)  # the trouble is over: the pin moves on, keep_last as before
    layout.apply_retention(tmp_path, keep_last=2)
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [31, 36]


def test_checkpoints_of_a_diverged_state_never_count_toward_keep_last(tmp_path: Path) -> None:
    """NaN checkpoints every window left only NaN ones under keep_last=3, and the resume
    loaded NaN weights (QA B1): they are not counted, only the newest is kept, and loading
    tries every finite checkpoint first."""
    for step in (6, 11):
        _make(tmp_path, step)
    for step in (16, 21, 26, 31):
        _mark(_make(tmp_path, step), finite=False, anomaly="non-finite loss since step 16")
        layout.apply_retention(tmp_path, keep_last=2)
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [6, 11, 31]
    assert [c.step for c in layout.load_order(tmp_path)] == [11, 6, 31]
    for step in (36, 41):  # finite again (resumed, say): the diverged one is dropped
        _make(tmp_path, step)
        layout.apply_retention(tmp_path, keep_last=2)
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [36, 41]


def test_a_manifest_without_the_marks_reads_as_finite_and_clean(tmp_path: Path) -> None:
    d = _make(tmp_path, 5)
    manifest = json.loads((d / layout.COMMIT_NAME).read_text())
    del manifest["finite"], manifest["anomaly"]
    (d / layout.COMMIT_NAME).write_text(json.dumps(manifest))
    assert layout.marks(layout.list_checkpoints(tmp_path)[0]) == (True, None)
