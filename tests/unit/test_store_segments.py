"""The segment writer: crash safety, restarts, merges, and reading through `open`/`query`."""

from __future__ import annotations

import math
import time

import pyarrow as pa
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


@staticmethod
def _failing_parquet_write(table, where, token):
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

    monkeypatch.setattr(segments.SegmentWriter, "_write_batch", _failing_parquet_write)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(StoreError, match="cannot write segment .*disk is full"):
        w.write(_batch(10))


def test_a_failed_flush_write_leaves_no_partial_segment(tmp_path, monkeypatch):
    from trainspec.store import segments

    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(_batch(0))
    monkeypatch.setattr(segments.SegmentWriter, "_write_batch", _failing_parquet_write)
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
    """A DuckDB connection whose COPY fails, as on a full or read-only disk (only a COPY
    that reads the file named `reading`, when one is given)."""

    def __init__(self, con, reading: str = ""):
        self._con = con
        self._reading = reading

    def execute(self, sql, *args):
        import duckdb

        if sql.startswith("COPY") and self._reading in sql:
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


def test_a_name_another_writers_merge_freed_is_not_written_under_its_merge(tmp_path):
    """Two writers under one id: A merges seg-0-0 and seg-1-1 into seg-0-1 and deletes them;
    B, still at sequence 0, could claim seg-0-0 again, and every reader left it out under
    seg-0-1 (and so did `trainspec compact`)."""
    a = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    b = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    a.write(_batch(0))
    a.write(_batch(10))
    assert a.merge() == 1
    written = [b.write(_batch(100)), b.write(_batch(110))]
    assert [p.name for p in written] == ["seg-0000000002-0000000002.parquet",
                                         "seg-0000000003-0000000003.parquet"]  # fmt: skip
    assert _count(tmp_path) == (40, 40)
    from trainspec.store.compact import compact

    compact(tmp_path)
    assert _count(tmp_path) == (40, 40)


def test_listing_keeps_what_no_other_file_covers():
    """The sweep gives what comparing every pair gave, on random sets of ranges."""
    import random
    from pathlib import Path

    from trainspec.store.layout import SegmentFile, visible

    rng = random.Random(0)
    for _ in range(500):
        found = set()
        for _ in range(rng.randint(0, 12)):
            first = rng.randint(0, 15)
            last = rng.randint(first, 15)
            found.add(SegmentFile(first, last, Path(f"seg-{first}-{last}")))
        files = sorted(found)
        assert visible(files) == [s for s in files if not any(o.covers(s) for o in files)]


def _write_foreign(writer: SegmentWriter, seq: int, table) -> None:
    import pyarrow.parquet as pq

    from trainspec.store.layout import segment_name

    pq.write_table(table, writer.dir / segment_name(seq, seq))


def test_a_merge_leaves_out_a_window_with_a_segment_the_reader_skips(tmp_path):
    """DuckDB takes a merge's columns from its first file: a first file without a column
    made the merged file unreadable, and the good rows merged with it went out of every
    view. The window is left alone; the later one merges."""
    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    w._next_seq = 1
    _write_foreign(w, 0, _batch(0).drop(["attrs"]))  # an odd layout first
    for i in range(1, 4):
        w.write(_batch(10 * i))
    assert w.merge() == 1  # seg-1-2; seg-0-0 stays as it is
    spans = [(s.first, s.last) for s in list_writer_segments(w.dir)]
    assert spans == [(0, 0), (1, 2), (3, 3)]
    assert _count(tmp_path) == (30, 30)  # every good row, the odd file skipped by name


def test_a_window_whose_merge_fails_does_not_stop_the_later_ones(tmp_path, monkeypatch):
    """A segment whose footer reads but whose pages do not failed the first window's merge
    at every flush, and no later window was tried: files piled up for the rest of the run."""
    import trainspec.store.segments as segments

    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    for i in range(4):
        w.write(_batch(10 * i))
    opened = segments._merge_connection
    first = segments.segment_name(0, 0)
    monkeypatch.setattr(segments, "_merge_connection", lambda: _FailingCopy(opened(), first))
    with pytest.raises(StoreError, match="disk is full"):
        w.merge()
    spans = [(s.first, s.last) for s in list_writer_segments(w.dir)]
    assert spans == [(0, 0), (1, 1), (2, 3)]
    monkeypatch.undo()
    assert w.merge() == 2  # tried again at the next flush: (0, 1), then (0, 3)
    assert [(s.first, s.last) for s in list_writer_segments(w.dir)] == [(0, 3)]
    assert _count(tmp_path) == (40, 40)


def test_segments_are_on_disk_before_their_name_and_a_merge_before_its_inputs_go(
    tmp_path, monkeypatch
):
    """Nothing was fsynced: after a host crash a merged name could stand on an empty file
    with its inputs already deleted."""
    import os

    import trainspec.store.segments as segments

    log: list[str] = []
    real_sync, real_unlink, real_link = segments.sync_path, os.unlink, os.link
    monkeypatch.setattr(
        segments, "sync_path", lambda p: (log.append(f"sync {p.name}"), real_sync(p))
    )
    monkeypatch.setattr(segments.os, "link", lambda a, b: (log.append("name"), real_link(a, b)))
    monkeypatch.setattr(segments.os, "replace",
                        lambda a, b: (log.append("name"), os.rename(a, b)))  # fmt: skip

    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    w.write(_batch(0))
    assert [e.split(" ")[0] for e in log] == ["sync", "name", "sync"]
    assert log[-1] == f"sync {w.dir.name}"  # the directory entry
    w.write(_batch(10))
    log.clear()
    monkeypatch.setattr(
        type(w.dir), "unlink", lambda p, missing_ok=False: (log.append("unlink"), real_unlink(p))
    )
    assert w.merge() == 1
    assert log[:3] == [log[0], "name", f"sync {w.dir.name}"] and log[0].startswith("sync .seg")
    assert log[3:] == ["unlink", "unlink"]


def test_a_segment_another_writers_merge_took_in_is_not_written_twice(tmp_path):
    """A claims seg-1-1; before A lists the directory, B (same writer id) merges seg-0-0 and
    seg-1-1 into seg-0-1 and has not yet deleted its inputs. A's file is covered but its
    rows are in the merge: writing them again stored them twice."""
    import trainspec.store.segments as segments

    a = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    b = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    first, mine = a.write(_batch(0)), a.write(_batch(10))
    token = segments._token_of(mine)
    assert token and token != segments._token_of(first)
    merged = b.dir / segments.segment_name(0, 1)
    con = segments._merge_connection()
    inputs = [segments._token_of(first), token]
    b._copy_out([first, mine], merged, con, token=segments._new_token(), inputs=inputs)
    assert not a._hidden(mine, 1, token)  # taken in: its rows are under seg-0-1
    assert a._hidden(mine, 1, segments._new_token())  # a cover without it: hidden
    stale = b.dir / segments.segment_name(0, 3)
    b._copy_out([first], stale, con, token=segments._new_token(), inputs=inputs[:1])
    con.close()
    assert a._hidden(mine, 1, token)  # the widest cover does not hold it


def test_a_merge_reads_each_file_by_column_name_in_the_stores_types(tmp_path):
    """DuckDB took a merge's column types from its first file: an integer `value` column
    first rounded the later files' 0.75 to 1; an extra column failed the merge at every
    flush."""
    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=4)
    w._next_seq = 2
    ints = _batch(0, n=2).set_column(3, "value", pa.array([1, 2], pa.int64()))
    _write_foreign(w, 0, ints)
    _write_foreign(w, 1, _batch(2, n=2).append_column("extra", pa.array(["x", "y"])))
    w.write(_batch(4, n=2))  # values 0.5
    w.write(_batch(6, n=2))
    before = store.query(tmp_path, "SELECT sum(value) AS s FROM samples").column("s")[0].as_py()
    assert w.merge() == 1
    assert [(s.first, s.last) for s in list_writer_segments(w.dir)] == [(0, 3)]
    after = store.query(tmp_path, "SELECT sum(value) AS s FROM samples").column("s")[0].as_py()
    assert before == after == 1 + 2 + 0.5 * 6


def test_a_write_named_before_a_directory_fsync_fails_is_stored_and_returned(
    tmp_path, monkeypatch, caplog
):
    """The rows are read from the moment the file has its name: a write that raised then
    was counted as dropped (and the agent, told it failed, had the rank send it again)."""
    import trainspec.store.segments as segments

    real = segments.sync_path

    def no_dir_sync(path):
        if path.is_dir():
            raise OSError(5, "Input/output error")
        real(path)

    w = SegmentWriter(tmp_path, "samples", "rank-0", fanout=2)
    monkeypatch.setattr(segments, "sync_path", no_dir_sync)
    assert w.write(_batch(0)).name == "seg-0000000000-0000000000.parquet"
    assert w.write(_batch(10)) is not None
    assert "fsync of its directory failed" in caplog.text
    with pytest.raises(StoreError, match="inputs are kept"):
        w.merge()
    assert _count(tmp_path) == (20, 20)  # the merge covers its inputs, each row once
    monkeypatch.undo()
