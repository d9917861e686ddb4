"""Damaged and foreign files in a run directory: each is left out with a warning that names
it, the rest of the run is read, compaction keeps the store's column types and every file
it could not read, and a live compaction lists again when a rank merges segments away."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trainspec.store as store
import trainspec.store.reader as reader
from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main
from trainspec.store import SegmentWriter, StoreError
from trainspec.store.layout import COMPACT_NAME
from trainspec.store.tables import TABLES, to_arrow

N = 40  # rows per segment
SQL = {"double": "DOUBLE", "int32": "INTEGER", "int64": "BIGINT", "string": "VARCHAR"}


def _samples(first: int, rank: int = 0, n: int = N) -> pa.Table:
    return to_arrow(
        "samples",
        {
            "ts": [1e9 + first + i for i in range(n)],
            "rank": [rank] * n,
            "metric": ["m.x"] * n,
            "value": [float(i) for i in range(n)],
            "attrs": ["{}"] * n,
        },
    )


def _run(tmp_path: Path, segments: int = 3, ranks: int = 2) -> Path:
    """A run of `segments` samples segments of N rows per rank, a runs row and a step each."""
    run = tmp_path / "run"
    for rank in range(ranks):
        w = SegmentWriter(run, "samples", f"rank-{rank}")
        for s in range(segments):
            w.write(_samples(s * N, rank))
        w = SegmentWriter(run, "steps", f"rank-{rank}")
        w.write(to_arrow("steps", {"ts": [1e9 + 1], "rank": [rank], "step": [0]}))
        w = SegmentWriter(run, "runs", f"rank-{rank}")
        w.write(to_arrow("runs", {"run_id": ["r"], "rank": [rank], "world_size": [ranks]}))
    return run


def _segment(run: Path, rank: int = 0, i: int = 0, table: str = "samples") -> Path:
    return sorted((run / "segments" / table / f"rank-{rank}").glob("seg-*.parquet"))[i]


def _damage_pages(path: Path) -> bytes:
    """Overwrite the first page header: the footer still reads, the rows do not."""
    data = bytearray(path.read_bytes())
    data[4:204] = b"\xab" * 200
    path.write_bytes(bytes(data))
    pq.read_metadata(path)  # still a readable footer
    return bytes(data)


def _count(run, sql: str = "SELECT count(*) FROM samples") -> int:
    return store.query(run, sql).column(0)[0].as_py()


ALL_COLUMNS = "SELECT count(*), sum(hash(ts, rank, metric, value, attrs)) FROM samples"


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    """Each test as a fresh process sees it: nothing read through or checked yet."""
    monkeypatch.setattr(reader, "_checked", {})
    monkeypatch.setattr(reader, "_read_through", {}, raising=False)


# --- 1. a segment of the wrong schema -------------------------------------------------------


def _wrongly_typed(run: Path) -> Path:
    bad = run / "segments" / "samples" / "rank-0" / "seg-0000000009-0000000009.parquet"
    table = {"ts": ["x"], "rank": ["0"], "metric": ["m"], "value": [1.0], "attrs": ["{}"]}
    pq.write_table(pa.table(table), bad)
    return bad


def test_a_wrongly_typed_segment_is_skipped_by_name(tmp_path):
    run = _run(tmp_path)
    bad = _wrongly_typed(run)
    table, skipped = store.query_with_skipped(
        run, "SELECT sum(ts), typeof(any_value(ts)) FROM samples"
    )
    assert table.column(1)[0].as_py() == "DOUBLE"
    ((path, why),) = skipped
    assert path == str(bad) and "'ts'" in why and "string" in why


def test_a_segment_missing_a_column_is_skipped_by_name(tmp_path):
    run = _run(tmp_path)
    bad = run / "segments" / "samples" / "rank-1" / "seg-0000000009-0000000009.parquet"
    pq.write_table(_samples(999).drop_columns(["attrs"]), bad)
    _, skipped = store.query_with_skipped(run, "SELECT count(*) FROM samples")
    assert skipped == [(str(bad), "not a samples segment: column 'attrs' is missing")]


def test_a_segment_of_narrower_types_is_read_as_the_stores(tmp_path):
    run = _run(tmp_path)
    narrow = pa.schema([("ts", pa.float32()), ("rank", pa.int16()), ("metric", pa.string()),
                        ("value", pa.int64()), ("attrs", pa.large_string())])  # fmt: skip
    seg = run / "segments" / "samples" / "rank-1" / "seg-0000000009-0000000009.parquet"
    pq.write_table(_samples(0, 1, 3).cast(narrow), seg)
    sql = "SELECT count(*), typeof(any_value(rank)), typeof(any_value(value)) FROM samples"
    table, skipped = store.query_with_skipped(run, sql)
    assert skipped == []
    assert [c[0].as_py() for c in table.columns] == [2 * 3 * N + 3, "INTEGER", "DOUBLE"]


def test_compaction_keeps_the_stores_types_and_recompaction_reads(tmp_path, capsys):
    run = _run(tmp_path)
    bad = _wrongly_typed(run)
    assert main(["compact", str(run)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["compact", str(run), "--skip-unreadable"]) == 0
    assert str(bad) in capsys.readouterr().err
    con = duckdb.connect(str(run / COMPACT_NAME), read_only=True)
    for table, schema in TABLES.items():
        types = dict(
            con.execute(f"SELECT column_name, column_type FROM (DESCRIBE {table})").fetchall()
        )
        assert types == {f.name: SQL[str(f.type)] for f in schema}, table
    con.close()
    bad.unlink()  # the segment goes; the compacted file must still read beside the others
    assert main(["query", str(run), "SELECT count(*) FROM steps", "--csv"]) == 0
    assert capsys.readouterr().out.split() == ["count_star()", "2"]
    assert main(["compact", str(run)]) == 0
    assert _count(run / COMPACT_NAME) == 2 * 3 * N


def test_a_run_duckdb_widened_by_an_older_compaction_is_read_and_repaired(tmp_path):
    run = _run(tmp_path)
    store.compact(run)
    widened = tmp_path / "widened.duckdb"
    con = duckdb.connect(str(widened))
    con.execute(f"ATTACH '{run / COMPACT_NAME}' AS old (READ_ONLY)")
    for table in TABLES:
        if table == "samples":  # as `CREATE TABLE AS SELECT *` over a text-typed segment made it
            con.execute("CREATE TABLE samples AS SELECT ts::VARCHAR AS ts, rank::VARCHAR AS rank, "
                        "metric, value, attrs FROM old.samples")  # fmt: skip
        else:
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM old.{table}")
    con.close()
    os.replace(widened, run / COMPACT_NAME)
    os.unlink(_segment(run, 1, 0))  # rows only the compacted file holds now
    assert _count(run) == 2 * 3 * N
    assert _count(run, "SELECT count(*) FROM samples WHERE ts BETWEEN 0 AND 2e9") == 2 * 3 * N
    store.compact(run)
    t = store.query(run / COMPACT_NAME, "SELECT typeof(any_value(ts)), count(*) FROM samples")
    assert [c[0].as_py() for c in t.columns] == ["DOUBLE", 2 * 3 * N]


def test_validate_names_a_wrongly_typed_segment_and_judges_the_rest(tmp_path, capsys):
    run = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    bad = _wrongly_typed(run)
    assert main(["validate", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"segment skipped as unreadable: {bad}" in out and "COMPLIANT" in out


# --- 2. damage behind a readable footer -----------------------------------------------------


def test_a_segment_damaged_behind_its_footer_is_found_named_and_left_out(tmp_path):
    run = _run(tmp_path)
    bad = _segment(run, 0, 1)
    _damage_pages(bad)
    table, skipped = store.query_with_skipped(run, ALL_COLUMNS)
    assert table.column(0)[0].as_py() == 2 * 3 * N - N
    ((path, why),) = skipped
    assert path == str(bad) and "damaged" in why


def test_the_damage_is_found_when_views_are_built_beside_a_compacted_file(tmp_path):
    run = _run(tmp_path)
    store.compact(run)
    bad = _segment(run, 1, 2)
    _damage_pages(bad)
    table, skipped = store.query_with_skipped(run, ALL_COLUMNS)
    assert table.column(0)[0].as_py() == 2 * 3 * N  # its rows, from run.duckdb
    assert [p for p, _ in skipped] == [str(bad)]


def test_validate_and_the_open_connection_name_the_damaged_segment(tmp_path, capsys):
    run = make_compliant_run(tmp_path / "run", ranks=1, seconds=2.0)
    bad = _segment(run, 0, 0)
    _damage_pages(bad)
    main(["validate", str(run)])
    out, err = capsys.readouterr()
    assert f"segment skipped as unreadable: {bad}" in out, out + err
    con = store.open(run)  # a caller's own statements (the dashboard's) recover as well
    try:
        con.execute(ALL_COLUMNS).fetchall()
        assert [p for p, _ in store.skipped_segments(con)] == [str(bad)]
    finally:
        con.close()


def test_a_damaged_segments_reason_is_one_printable_line(tmp_path):
    run = make_compliant_run(tmp_path / "run", ranks=1, seconds=2.0)
    bad = _segment(run)
    data = bytearray(bad.read_bytes())
    data[60:400] = bytes(b ^ 0x5A for b in data[60:400])  # DuckDB quotes a byte of it back
    bad.write_bytes(bytes(data))
    _, skipped = store.query_with_skipped(run, ALL_COLUMNS)
    ((path, why),) = skipped
    assert path == str(bad) and why.isprintable(), why


def test_compact_skips_a_damaged_segment_keeps_it_and_leaves_its_rows_out(tmp_path, capsys):
    run = _run(tmp_path)
    bad = _segment(run, 0, 1)
    damaged = _damage_pages(bad)
    assert main(["compact", str(run)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(bad) in err and "--skip-unreadable" in err
    assert not (run / COMPACT_NAME).exists()
    assert main(["compact", str(run), "--skip-unreadable"]) == 0
    err = capsys.readouterr().err
    assert f"skipped unreadable segment {bad}" in err
    assert bad.read_bytes() == damaged  # left for the user
    assert _count(run / COMPACT_NAME) == 2 * 3 * N - N
    # Not counted as folded: read again, the damaged segment is still named, not hidden.
    _, skipped = store.query_with_skipped(run, ALL_COLUMNS)
    assert [p for p, _ in skipped] == [str(bad)]
    assert main(["compact", str(run), "--skip-unreadable"]) == 0
    assert str(bad) in capsys.readouterr().err and bad.read_bytes() == damaged


def test_a_run_duckdb_damaged_past_its_header_is_skipped_and_kept(tmp_path, capsys):
    run = make_compliant_run(tmp_path / "run", ranks=2, seconds=2.0)
    total = _count(run, ALL_COLUMNS)
    store.compact(run)
    base = run / COMPACT_NAME
    os.truncate(base, base.stat().st_size * 2 // 5)  # opens; its tables do not read
    cut = base.read_bytes()
    table, skipped = store.query_with_skipped(run, ALL_COLUMNS)
    assert table.column(0)[0].as_py() == total
    ((path, why),) = skipped
    assert path == str(base) and "damaged" in why
    assert main(["compact", str(run)]) == 2
    assert str(base) in capsys.readouterr().err
    assert main(["compact", str(run), "--skip-unreadable"]) == 0
    err = capsys.readouterr().err
    assert f"kept as {run / 'run.duckdb.damaged'}" in err
    assert (run / "run.duckdb.damaged").read_bytes() == cut
    assert _count(base, ALL_COLUMNS) == total


def test_a_healthy_query_reads_nothing_through(tmp_path, monkeypatch):
    run = _run(tmp_path)
    store.compact(run)

    def fail(*args):
        raise AssertionError("a healthy run was read through")

    monkeypatch.setattr(reader, "_locate_damage", fail)
    assert _count(run, ALL_COLUMNS) == 2 * 3 * N


def test_a_query_error_of_the_users_own_is_reported_as_such(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(duckdb.BinderException):
        store.query(run, "SELECT no_such_column FROM samples")
    with pytest.raises(duckdb.ConversionException):
        store.query(run, "SELECT CAST(metric AS INTEGER) FROM samples")


# --- 3. a merge between listing and reading -------------------------------------------------


def test_compaction_lists_again_when_a_rank_merges_after_the_listing(tmp_path, monkeypatch):
    run = tmp_path / "run"
    w = SegmentWriter(run, "samples", "rank-0", fanout=2)
    w.write(_samples(0))
    w.write(_samples(N))  # two segments of one size class: the next merge() folds them
    real = reader._create_views
    merges = []

    def create_then_merge(con, snap, *, exact):
        real(con, snap, exact=exact)
        if not merges:  # the rank merges right after the compaction listed its files
            merges.append(w.merge())

    monkeypatch.setattr(reader, "_create_views", create_then_merge)
    store.compact(run)
    assert merges == [1]
    assert _count(run / COMPACT_NAME) == 2 * N


def test_a_segment_merged_away_after_its_stat_is_not_called_unreadable(tmp_path, monkeypatch):
    run = _run(tmp_path, ranks=1)
    gone = _segment(run)
    real = pq.read_metadata

    def merged_meanwhile(path, *args, **kwargs):
        if Path(path) == gone:
            gone.unlink()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reader.pq, "read_metadata", merged_meanwhile)
    snap = reader._snapshot_once(run)[0]
    assert snap.skipped == [] and gone not in snap.files["samples"]


# --- 4. what is not a regular file ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_fifo_named_like_a_segment_is_skipped_not_waited_on(tmp_path, capsys):
    run = _run(tmp_path)
    fifo = run / "segments" / "samples" / "rank-0" / "seg-0000000009-0000000009.parquet"
    os.mkfifo(fifo)
    # Should the reader open it, a writer opened later lets the open return: fail, not hang.
    watchdog = threading.Timer(10, lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))
    watchdog.start()
    try:
        assert main(["query", str(run), "SELECT count(*) FROM samples", "--csv"]) == 0
    finally:
        watchdog.cancel()
    out, err = capsys.readouterr()
    assert out.split()[-1] == str(2 * 3 * N)
    assert f"skipped unreadable segment {fifo} (not a regular file)" in err
    assert main(["compact", str(run), "--skip-unreadable"]) == 0
    assert str(fifo) in capsys.readouterr().err


def test_a_dangling_symlink_segment_is_warned_about(tmp_path, capsys):
    run = _run(tmp_path)
    link = run / "segments" / "steps" / "rank-1" / "seg-0000000009-0000000009.parquet"
    link.symlink_to(tmp_path / "elsewhere.parquet")
    assert main(["query", str(run), "SELECT count(*) FROM steps"]) == 0
    err = capsys.readouterr().err
    assert f"skipped unreadable segment {link}" in err and "does not exist" in err
    with pytest.raises(StoreError, match="seg-0000000009-0000000009"):
        store.compact(run)


def test_a_querys_own_error_reads_no_file_through(tmp_path, monkeypatch):
    """Malformed JSON or an overflow in the user's SQL is the query's error: it once made
    the reader read every file of the run through, looking for damage (review)."""
    run = _run(tmp_path)
    reads: list[str] = []
    real = reader._read_through_ok
    monkeypatch.setattr(reader, "_read_through_ok", lambda con, src: (reads.append(src),
                                                                      real(con, src)))  # fmt: skip
    for sql in (
        "SELECT json_extract('{bad', '$.a') FROM samples",
        "SELECT 2147483647::INTEGER + CAST(count(*) AS INTEGER) FROM samples",
    ):
        with pytest.raises((StoreError, duckdb.Error)):
            store.query_with_skipped(run, sql)
    assert reads == []


class _FlakyConnection:
    """Fails a read through with `errors`, one per call, then reads."""

    def __init__(self, *errors: duckdb.Error) -> None:
        self.errors = list(errors)

    def execute(self, sql: str):
        if self.errors:
            raise self.errors.pop(0)
        return self

    def fetchall(self):
        return [(1, 0)]


def test_a_failure_of_the_moment_is_never_remembered_as_damage():
    """A process out of file descriptors (a busy dashboard) once had every file it tried
    marked damaged for the life of the process (review)."""
    con = _FlakyConnection(duckdb.IOException("IO Error: Too many open files"))
    with pytest.raises(duckdb.Error):
        reader._damage_reason(con, "read_parquet(['x'])")
    # A failure that does not repeat is not damage either.
    assert reader._damage_reason(_FlakyConnection(duckdb.Error("bad")), "s") is None
    twice = _FlakyConnection(
        duckdb.Error("Variable-length int"), duckdb.Error("Variable-length int")
    )
    assert reader._damage_reason(twice, "s") == "damaged: Variable-length int"


def test_a_run_duckdb_another_process_holds_is_not_set_aside_as_damaged(tmp_path):
    """A lock is not damage: compact --skip-unreadable renamed a run.duckdb that another
    process held open to run.duckdb.damaged, and the new file lacked the rows only it held
    (review)."""
    import subprocess
    import sys

    run = _run(tmp_path)
    store.compact(run)
    target = run / COMPACT_NAME
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True);"
         " time.sleep(60)", str(target)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match="cannot be read now"):
            store.compact(run, skip_unreadable=True)
        assert target.is_file() and not list(run.glob("*.damaged*"))
    finally:
        holder.kill()
        holder.wait(10)


def test_the_readers_file_caches_stay_bounded(tmp_path, monkeypatch):
    """A key per segment file ever seen, never dropped: a dashboard refreshing a live run
    kept one for every small segment merged away since it started."""
    monkeypatch.setattr(reader, "CACHE_LIMIT", 3)
    monkeypatch.setattr(reader, "_checked", reader._Bounded())
    w = SegmentWriter(tmp_path, "steps", "rank-0", fanout=1000)
    for step in range(8):
        w.write(to_arrow("steps", {"ts": [float(step)], "rank": [0], "step": [step]}))
        store.query(tmp_path, "SELECT count(*) FROM steps")
    assert len(reader._checked) == 3
    assert store.query(tmp_path, "SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 8


def test_a_file_where_a_tables_segments_belong_is_named(tmp_path):
    """A regular file at segments/steps was read as a run without steps, without a word."""
    w = SegmentWriter(tmp_path, "samples", "rank-0")
    w.write(to_arrow("samples", {"ts": [1.0], "rank": [0], "metric": ["m"], "value": [1.0],
                                 "attrs": ["{}"]}))  # fmt: skip
    (tmp_path / "segments" / "steps").write_text("not a directory")
    table, skipped = store.query_with_skipped(tmp_path, "SELECT count(*) AS n FROM samples")
    assert table.column("n")[0].as_py() == 1
    assert [(Path(p).name, r.split(":")[0]) for p, r in skipped] == [("steps", "not a directory")]


@pytest.mark.parametrize("name", ["run*", "r?", "b[1]"])
def test_a_run_whose_path_has_glob_characters_reads_and_compacts_only_its_own_rows(
    tmp_path: Path, name: str
) -> None:
    """read_parquet takes each path as a glob: `runs/run*` also read `runs/run-other` (and
    compaction stored those rows in its run.duckdb); under `r?` compaction failed, DuckDB
    cutting the database path at '?' for its write-ahead log."""
    run = make_compliant_run(tmp_path / name, ranks=1, seconds=1.0)
    for sibling in ("run-other", "ra", "b1"):
        make_compliant_run(tmp_path / sibling, ranks=1, seconds=1.0)
    own = store.query(make_compliant_run(tmp_path / "alone", ranks=1, seconds=1.0),
                      "SELECT count(*) FROM samples").column(0)[0].as_py()  # fmt: skip
    assert store.query(run, "SELECT count(*) FROM samples").column(0)[0].as_py() == own
    compacted = store.compact(run)
    with duckdb.connect(str(compacted), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == own
    assert store.query(run, "SELECT count(*) FROM samples").column(0)[0].as_py() == own
