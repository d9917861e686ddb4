"""The segment writer: crash safety, restarts, merges, and reading through `open`/`query`."""

from __future__ import annotations

import math
import time

import pytest

import trainspec.store as store
from trainspec.store import SegmentWriter, StoreError
from trainspec.store.layout import list_writer_segments
from trainspec.store.tables import to_arrow


def _batch(first: int, n: int = 10, rank: int = 0):
    return to_arrow(
        "samples",
        {
            "ts": [float(first + i) for i in range(n)],
            "rank": [rank] * n,
            "metric": ["trainspec.host.cpu.utilization"] * n,
            "value": [0.5] * n,
            "attrs": ["{}"] * n,
        },
    )


def _count(run) -> tuple[int, int]:
    row = store.query(run, "SELECT count(*) AS n, count(DISTINCT ts) AS d FROM samples")
    return row.column("n")[0].as_py(), row.column("d")[0].as_py()


def test_written_rows_read_back(tmp_path):
    w = SegmentWriter(tmp_path, "samples", "rank-0")
    for i in range(5):
        assert w.write(_batch(i * 10)).name == f"seg-{i:010d}-{i:010d}.parquet"
    assert w.write(_batch(0, n=0)) is None
    assert _count(tmp_path) == (50, 50)


def test_leftover_temp_file_is_ignored(tmp_path):
    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(_batch(0))
    # What a crash between COPY and rename leaves behind: a hidden, half-written temp file.
    (w.dir / ".seg-0000000001-0000000001.parquet.deadbeef.tmp").write_bytes(b"PAR1 partial")
    con = store.open(tmp_path)
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 10
    assert store.skipped_segments(con) == []
    con.close()


def test_truncated_segment_is_reported_by_name_and_skipped(tmp_path):
    w = SegmentWriter(tmp_path, "samples", "rank-0")
    paths = [w.write(_batch(i * 10)) for i in range(3)]
    SegmentWriter(tmp_path, "steps", "rank-0").write(
        to_arrow("steps", {"ts": [1.0], "rank": [0], "step": [0]})
    )
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])
    con = store.open(tmp_path)
    (skipped,) = store.skipped_segments(con)
    assert skipped[0] == str(paths[1]) and skipped[1]
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 20
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 1
    con.close()


def test_restarted_writer_continues_the_sequence(tmp_path):
    SegmentWriter(tmp_path, "samples", "rank-0").write(_batch(0))
    again = SegmentWriter(tmp_path, "samples", "rank-0")
    assert again.write(_batch(10)).name == "seg-0000000001-0000000001.parquet"
    assert _count(tmp_path) == (20, 20)


@pytest.mark.parametrize(
    ("table", "writer"),
    [("nope", "rank-0"), ("samples", ""), ("samples", "../x"), ("samples", ".h")],
)
def test_bad_table_or_writer_id_is_refused(tmp_path, table, writer):
    with pytest.raises(StoreError):
        SegmentWriter(tmp_path, table, writer)


def test_merge_keeps_every_row_once_and_few_files(tmp_path):
    fanout, writes = 4, 130
    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=fanout)
    for i in range(writes):
        w.write(_batch(i * 10))
        w.merge()
    files = list_writer_segments(w.dir)
    # Log-structured merge: at most fanout-1 files per size class.
    assert len(files) <= (fanout - 1) * math.ceil(math.log(writes, fanout))
    assert sum(s.span for s in files) == writes  # the ranges tile the sequence
    assert len(list(w.dir.iterdir())) == len(files)  # inputs deleted, no temp files left
    assert _count(tmp_path) == (writes * 10, writes * 10)


def test_a_day_long_run_stays_tens_of_files(tmp_path):
    # A day of flushes every 60 s (1,440 segments) at the default fanout of 16.
    w = SegmentWriter(tmp_path, "samples", "rank-0")
    start = time.perf_counter()
    for i in range(1440):
        w.write(_batch(i, n=1))
        if i % 16 == 15:
            w.merge()
    w.merge()
    files = list_writer_segments(w.dir)
    assert 1 <= len(files) <= 30, len(files)
    assert _count(tmp_path) == (1440, 1440)
    assert time.perf_counter() - start < 60


def test_a_removed_segment_directory_is_made_again_for_the_next_segment(tmp_path):
    import shutil

    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(_batch(0))
    shutil.rmtree(w.dir)
    w.write(_batch(10))
    assert _count(tmp_path) == (10, 10)  # what came after the removal is stored


def _failing_parquet_write(table, where, **kwargs):
    """pyarrow's writer on a full disk: part of the file is there, then the write fails."""
    with open(where, "wb") as out:
        out.write(b"PAR1")
    raise OSError(28, "disk is full")


def test_a_failed_write_reports_its_own_error_when_the_clean_up_fails_too(tmp_path, monkeypatch):
    from pathlib import Path

    from trainspec.store import segments

    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(_batch(0))

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(segments.pq, "write_table", _failing_parquet_write)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(StoreError, match="cannot write segment .*disk is full"):
        w.write(_batch(10))


def test_a_failed_flush_write_leaves_no_partial_segment(tmp_path, monkeypatch):
    from trainspec.store import segments

    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(_batch(0))
    monkeypatch.setattr(segments.pq, "write_table", _failing_parquet_write)
    with pytest.raises(StoreError, match="cannot write segment .*disk is full"):
        w.write(_batch(10))
    monkeypatch.undo()
    assert sorted(p.name for p in w.dir.iterdir()) == ["seg-0000000000-0000000000.parquet"]
    w.write(_batch(20))  # the sequence goes on where it stood
    assert _count(tmp_path) == (20, 20)


def test_a_failed_merge_reports_its_own_error_and_keeps_its_inputs(tmp_path, monkeypatch):
    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    w.write(_batch(0))
    w.write(_batch(10))
    import trainspec.store.segments as segments

    opened = segments._merge_connection
    monkeypatch.setattr(segments, "_merge_connection", lambda: _FailingCopy(opened()))
    with pytest.raises(StoreError, match="cannot write segment .*disk is full"):
        w.merge()
    assert len(list_writer_segments(w.dir)) == 2
    assert _count(tmp_path) == (20, 20)


class _FailingCopy:
    """A DuckDB connection whose COPY fails, as on a full or read-only disk."""

    def __init__(self, con):
        self._con = con

    def execute(self, sql, *args):
        import duckdb

        if sql.startswith("COPY"):
            raise duckdb.IOException("disk is full")
        return self._con.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._con, name)


def test_two_writers_under_one_id_never_replace_each_others_segments(tmp_path):
    # A second job given the same run id, or a second session: both start at sequence 0.
    a = SegmentWriter(tmp_path, "samples", "rank-0")
    b = SegmentWriter(tmp_path, "samples", "rank-0")
    for i in range(6):
        (a if i % 2 == 0 else b).write(_batch(100 * i))
    assert _count(tmp_path) == (60, 60)
    assert len(list_writer_segments(a.dir)) == 6


def _os_threads() -> int:
    from pathlib import Path

    return len(list(Path("/proc/self/task").iterdir()))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_writers_hold_no_duckdb_threads_between_merges(tmp_path):
    """A DuckDB connection keeps a pool of OS threads (8 with threads=1 on a 2-core machine,
    more on bigger hosts); four writers each holding one kept 30+ idle threads in every rank."""
    before = _os_threads()
    writers = [SegmentWriter(tmp_path, t, "rank-0", fanout=2) for t in ("samples", "steps")]
    writers += [SegmentWriter(tmp_path / "b", "samples", f"rank-{i}", fanout=2) for i in (0, 1)]
    for w in writers:
        if w.table == "samples":
            for i in range(2):
                w.write(_batch(10 * i))
            assert w.merge() == 1
    assert _os_threads() - before < 4
    assert _count(tmp_path) == (20, 20)
