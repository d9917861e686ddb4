"""A run directory holding both segments and a compacted `run.duckdb` whose rows the segments
do not all hold: a later job given the same run id, or segments deleted after compaction.
The reader shows both, and compaction folds the old file in rather than replacing it away."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

import trainspec.store as store
from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main
from trainspec.store import SegmentWriter
from trainspec.store.layout import COMPACT_NAME, list_table_segments
from trainspec.store.reader import _covered, _segments_sql, open_run, snapshot
from trainspec.store.tables import TABLES, to_arrow

PER_RANK = "SELECT rank, count(*) AS n FROM {table} GROUP BY rank ORDER BY rank"


def _counts(run, table: str = "samples") -> dict[int, int]:
    t = store.query(run, PER_RANK.format(table=table))
    return dict(zip(t.column("rank").to_pylist(), t.column("n").to_pylist()))


def _later_job(run_dir, rank: int = 0, n: int = 7, t0: float = 4e9) -> None:
    """A later job's samples under the same run id, as rank `rank`."""
    w = SegmentWriter(run_dir, "samples", f"rank-{rank}")
    rows = {
        "ts": [t0 + i for i in range(n)],
        "rank": [rank] * n,
        "metric": ["trainspec.host.cpu.utilization"] * n,
        "value": [0.25] * n,
        "attrs": ["{}"] * n,
    }
    w.write(to_arrow("samples", rows))


@pytest.fixture
def compacted_only(tmp_path):
    """A run kept as its run.duckdb alone (segments deleted after compaction)."""
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    store.compact(run_dir)
    before = _counts(run_dir)
    shutil.rmtree(run_dir / "segments")
    assert _counts(run_dir) == before  # read from run.duckdb now
    return run_dir, before


def test_a_later_job_on_a_compacted_run_id_adds_to_what_is_read(compacted_only):
    run_dir, before = compacted_only
    _later_job(run_dir)
    assert _counts(run_dir) == {0: before[0] + 7, 1: before[1]}
    assert _counts(run_dir, "runs") == {0: 1, 1: 1}  # the old run rows are still there


def test_compaction_folds_the_old_file_in_and_stays_idempotent(compacted_only, capsys):
    run_dir, before = compacted_only
    _later_job(run_dir)
    expected = {0: before[0] + 7, 1: before[1]}
    for _ in range(2):
        assert main(["compact", str(run_dir)]) == 0
        assert _counts(run_dir / COMPACT_NAME) == expected
        assert _counts(run_dir) == expected


def test_a_compacted_run_with_its_segments_kept_reads_each_row_once(tmp_path):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    before = _counts(run_dir)
    store.compact(run_dir)
    _later_job(run_dir, rank=1, t0=3e9)  # the same job writing on after compaction
    assert _counts(run_dir) == {0: before[0], 1: before[1] + 7}
    store.compact(run_dir)
    assert _counts(run_dir / COMPACT_NAME) == {0: before[0], 1: before[1] + 7}


def test_a_damaged_run_duckdb_beside_segments_is_reported_not_read(tmp_path):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    before = _counts(run_dir)
    (run_dir / COMPACT_NAME).write_bytes(b"not a database" * 100)
    table, skipped = store.query_with_skipped(run_dir, PER_RANK.format(table="samples"))
    assert dict(zip(table.column("rank").to_pylist(), table.column("n").to_pylist())) == before
    assert [p for p, _ in skipped] == [str(run_dir / COMPACT_NAME)]


def test_compact_reads_an_already_compacted_file_through(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    store.compact(run_dir)
    shutil.rmtree(run_dir / "segments")
    whole = (run_dir / COMPACT_NAME).read_bytes()
    (run_dir / COMPACT_NAME).write_bytes(whole[: len(whole) * 2 // 3])  # cut short: opens
    assert main(["compact", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and COMPACT_NAME in err


def test_a_segment_replaced_by_as_many_other_rows_does_not_hide_the_compacted_ones(tmp_path):
    """Same count per rank and the same time span, other rows: the compacted rows the
    segments lost are still read (a count and span comparison called this covered)."""
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    store.compact(run_dir)
    before = _counts(run_dir)
    middle = next(
        s.path for s in list_table_segments(run_dir, "samples") if "rank-0" in str(s.path)
    )
    lost = pq.read_table(middle)
    middle.unlink()
    span = store.query(run_dir / COMPACT_NAME, "SELECT min(ts), max(ts) FROM samples")
    lo = span.column(0)[0].as_py()
    _later_job(run_dir, rank=0, n=lost.num_rows, t0=lo)  # inside the span, as many rows
    assert _counts(run_dir) == {0: before[0] + lost.num_rows, 1: before[1]}


def test_a_compaction_with_its_segments_kept_is_read_from_the_segments_alone(tmp_path):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    store.compact(run_dir)
    con = open_run(run_dir)
    snap = snapshot(run_dir)
    for table in TABLES:
        assert _covered(con, table, _segments_sql(con, table, snap.files[table])), table
