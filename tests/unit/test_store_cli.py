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
    assert "no such run directory" in capsys.readouterr().err
