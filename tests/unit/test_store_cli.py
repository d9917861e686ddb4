"""`trainspec query` and `trainspec compact` on a synthetic run."""

from __future__ import annotations

import csv
import io
import json

import pytest

import trainspec.store as store
from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main

COUNT_SQL = "SELECT rank, count(*) AS n FROM samples GROUP BY rank ORDER BY rank"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_compliant_run(tmp_path_factory.mktemp("store") / "run", ranks=2, seconds=1.0)


def _expected(run_dir) -> list[tuple[int, int]]:
    t = store.query(run_dir, COUNT_SQL)
    return list(zip(t.column("rank").to_pylist(), t.column("n").to_pylist()))


def test_query_csv(run_dir, capsys):
    assert main(["query", str(run_dir), COUNT_SQL, "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["rank", "n"]
    assert [(int(r[0]), int(r[1])) for r in rows[1:] if r] == _expected(run_dir)


def test_query_json(run_dir, capsys):
    assert main(["query", str(run_dir), COUNT_SQL, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["rank"], d["n"]) for d in doc] == _expected(run_dir)


def test_query_text_is_a_table(run_dir, capsys):
    assert main(["query", str(run_dir), "SELECT DISTINCT kind FROM events"]) == 0
    assert "checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("target", "sql"),
    [(None, "SELEC nonsense FROM"), (None, "SELECT * FROM no_such_table"), ("/nope", "SELECT 1")],
)
def test_query_errors_exit_2_with_one_line(run_dir, capsys, target, sql):
    assert main(["query", target or str(run_dir), sql]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("trainspec query: error:")


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("DETACH _compacted; ATTACH '{run}/run.duckdb' AS x; DELETE FROM x.steps", "DETACH"),
        ("COPY (SELECT 1 AS a) TO '{run}/segments/steps/rank-0/seg-0000000000-0000000099.parquet'",
         "COPY"),
        ("SELECT 1; DELETE FROM steps", "DELETE"),
        ("CREATE TABLE t AS SELECT 1", "CREATE"),
        ("INSTALL httpfs", "LOAD"),
        ("EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{run}/x.parquet'", "EXPLAIN"),
    ],
)  # fmt: skip
def test_query_runs_nothing_that_could_change_the_run(tmp_path, capsys, sql, kind):
    """A DELETE through ATTACH emptied the compacted file's steps; a COPY over a segment's
    name hid the real segments' rows."""
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    store.compact(run_dir)
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert main(["query", str(run_dir), sql.format(run=run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"only SELECT queries run against a run (it is read, never changed); "
                        f"this is a {kind} statement")  # fmt: skip
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files
    assert (
        main(["query", str(run_dir), "WITH s AS (SELECT * FROM steps) SELECT count(*) FROM s"]) == 0
    )


def test_compact_is_idempotent(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    before = {
        t: store.query(run_dir, f"SELECT * FROM {t} ORDER BY ALL").to_pylist() for t in store.TABLES
    }
    assert main(["compact", str(run_dir)]) == 0
    assert main(["compact", str(run_dir)]) == 0
    assert capsys.readouterr().out.count("compacted into") == 2
    compacted = run_dir / "run.duckdb"
    for table, rows in before.items():
        assert store.query(compacted, f"SELECT * FROM {table} ORDER BY ALL").to_pylist() == rows
    assert main(["compact", str(compacted)]) == 0  # a compacted file compacts to itself


def test_compact_of_a_missing_run_exits_2(tmp_path, capsys):
    assert main(["compact", str(tmp_path / "absent")]) == 2
    assert f"{tmp_path / 'absent'} does not exist" in capsys.readouterr().err


def test_query_json_writes_what_duckdb_computes(run_dir, capsys):
    # sum() of a BIGINT is a HUGEINT (a Decimal in Python), to_timestamp() a datetime: both
    # are what people ask for, and json.dumps refused both.
    sql = (
        "SELECT rank, sum(step) AS total, to_timestamp(0) AS t0, 'inf'::DOUBLE AS inf, "
        "['nan'::DOUBLE] AS l FROM steps GROUP BY rank ORDER BY rank"
    )
    assert main(["query", str(run_dir), sql, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    totals = store.query(run_dir, "SELECT sum(step) FROM steps GROUP BY rank ORDER BY rank")
    assert [d["total"] for d in doc] == [int(v) for v in totals.column(0).to_pylist()]
    assert doc[0]["t0"].startswith("1970-01-01T00:00:00")
    assert doc[0]["inf"] == "Infinity" and doc[0]["l"] == ["NaN"]  # strict JSON has neither


@pytest.mark.parametrize("fmt", [[], ["--csv"]])
def test_query_keeps_columns_that_share_a_name(run_dir, capsys, fmt):
    assert main(["query", str(run_dir), "SELECT 1 AS a, 2 AS a", *fmt]) == 0
    out = capsys.readouterr().out
    if fmt:
        rows = [r for r in csv.reader(io.StringIO(out)) if r]
    else:
        rows = [line.split() for line in out.splitlines() if line.strip()]
    assert rows[0] == ["a", "a"] and rows[-1] == ["1", "2"]


def test_query_json_keeps_columns_that_share_a_name(run_dir, capsys):
    sql = "SELECT 1 AS a, 2 AS a, 3 AS a_2, 4 AS a"
    assert main(["query", str(run_dir), sql, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"a": 1, "a_3": 2, "a_2": 3, "a_4": 4}]


def test_compact_that_cannot_write_exits_2_and_keeps_everything(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    segments = sorted(p for p in (run_dir / "segments").rglob("*") if p.is_file())
    (run_dir / "run.duckdb").mkdir()  # the rename onto run.duckdb fails
    assert main(["compact", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "compaction failed" in err
    assert sorted(p for p in (run_dir / "segments").rglob("*") if p.is_file()) == segments
    assert not list(run_dir.glob(".run.duckdb*tmp"))  # no half-written file left behind
    (run_dir / "run.duckdb").rmdir()
    assert main(["compact", str(run_dir)]) == 0


def test_a_second_compaction_of_a_run_is_refused_while_one_runs(tmp_path, capsys):
    """Two at once built the same temporary file: one renamed the other's half-written file
    into place as run.duckdb, losing the rows only the old run.duckdb held."""
    import fcntl
    import os

    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    expected = store.query(run_dir, "SELECT count(*) FROM samples").column(0)[0].as_py()
    stale = run_dir / ".run.duckdb.999-deadbeef.tmp"
    stale.write_bytes(b"half a file from a compaction that was killed")
    wal = run_dir / ".run.duckdb.999-deadbeef.tmp.wal"  # its write-ahead log: kept for good
    wal.write_bytes(b"log")
    fd = os.open(run_dir / ".compact.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running compaction holds it
        assert main(["compact", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith("another compaction of this run is running")
        assert not (run_dir / "run.duckdb").exists() and stale.exists()
    finally:
        os.close(fd)
    assert main(["compact", str(run_dir)]) == 0
    assert not stale.exists() and not wal.exists()
    assert not list(run_dir.glob(".run.duckdb.*"))  # nor its own
    compacted = store.query(run_dir / "run.duckdb", "SELECT count(*) FROM samples")
    assert compacted.column(0)[0].as_py() == expected


def test_a_run_under_a_path_with_a_quote(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "bob's runs" / "run", ranks=1, seconds=1.0)
    expected = store.query(run_dir, "SELECT count(*) FROM samples").column(0)[0].as_py()
    assert expected > 0
    assert main(["compact", str(run_dir)]) == 0
    compacted = store.query(run_dir / "run.duckdb", "SELECT count(*) FROM samples")
    assert compacted.column(0)[0].as_py() == expected
    writer = store.SegmentWriter(run_dir, "steps", "rank-9", fanout=2)
    for _ in range(2):
        writer.write(store.query(run_dir, "SELECT * FROM steps LIMIT 1"))
    assert writer.merge() == 1  # merging reads the quoted paths back


def test_compact_refuses_to_replace_a_good_file_when_a_segment_cannot_be_read(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    assert main(["compact", str(run_dir)]) == 0
    good = (run_dir / "run.duckdb").read_bytes()
    segment = sorted((run_dir / "segments").rglob("*.parquet"))[0]
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) // 2])  # damaged after the first compaction
    capsys.readouterr()
    assert main(["compact", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and segment.name in err and "--skip-unreadable" in err
    assert (run_dir / "run.duckdb").read_bytes() == good  # the good file is kept
    assert main(["compact", str(run_dir), "--skip-unreadable"]) == 0


def test_compact_of_a_damaged_compacted_file_exits_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.duckdb").write_bytes(b"not a database" * 100)
    assert main(["compact", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.duckdb" in err


def test_a_compaction_whose_directory_fsync_fails_is_still_a_compaction(
    tmp_path, monkeypatch, caplog
):
    """The new run.duckdb was in place and the command said the compaction failed."""
    import importlib

    compact_module = importlib.import_module("trainspec.store.compact")  # not store.compact()
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)

    def no_dir_sync(path):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(compact_module, "sync_path", no_dir_sync)
    assert main(["compact", str(run_dir)]) == 0
    assert (run_dir / "run.duckdb").is_file() and "fsync of the directory failed" in caplog.text
