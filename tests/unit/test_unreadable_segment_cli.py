"""`trainspec query` and `trainspec report` over a run with one damaged segment: they answer
from the readable segments (exit 0) and name the skipped one on stderr, one line each."""

from __future__ import annotations

import pytest

import trainspec.store as store
from tests.helpers.dashboard_runs import make_dashboard_run
from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main


def _damage(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a truncated write: the footer is gone


def _warnings(err: str, command: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"trainspec {command}: warning")]


@pytest.fixture
def damaged_run(tmp_path):
    run_dir = make_compliant_run(tmp_path / "run", ranks=2, seconds=1.0)
    total = store.query(run_dir, "SELECT count(*) FROM steps").column(0)[0].as_py()
    segment = sorted((run_dir / "segments" / "steps").rglob("*.parquet"))[0]
    _damage(segment)
    return run_dir, segment, total


def test_query_names_the_skipped_segment_and_answers_from_the_rest(damaged_run, capsys):
    run_dir, segment, total = damaged_run
    assert main(["query", str(run_dir), "SELECT count(*) AS n FROM steps", "--csv"]) == 0
    out, err = capsys.readouterr()
    counted = int(out.splitlines()[1])
    assert 0 < counted < total  # the readable rows, and only those
    (line,) = _warnings(err, "query")
    assert str(segment) in line and "ArrowInvalid" in line


def test_query_of_a_whole_run_warns_nothing(tmp_path, capsys):
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    assert main(["query", str(run_dir), "SELECT count(*) FROM steps"]) == 0
    assert capsys.readouterr().err == ""


def test_query_warns_once_per_skipped_segment(damaged_run, capsys):
    run_dir, segment, _ = damaged_run
    second = sorted((run_dir / "segments" / "samples").rglob("*.parquet"))[-1]
    _damage(second)
    assert main(["query", str(run_dir), "SELECT 1"]) == 0
    lines = _warnings(capsys.readouterr().err, "query")
    assert len(lines) == 2
    assert str(segment) in lines[0] + lines[1] and str(second) in lines[0] + lines[1]


def test_report_names_the_skipped_segment_and_still_writes(tmp_path, capsys):
    run_dir = make_dashboard_run(tmp_path / "run", ranks=2, seconds=4.0)
    segment = sorted((run_dir / "segments" / "steps").rglob("*.parquet"))[0]
    _damage(segment)
    html = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--html", str(html)]) == 0
    assert html.is_file()
    (line,) = _warnings(capsys.readouterr().err, "report")
    assert str(segment) in line


def test_compact_still_refuses_and_validate_still_warns(damaged_run, capsys):
    run_dir, segment, _ = damaged_run
    assert main(["compact", str(run_dir)]) == 2
    assert "--skip-unreadable" in capsys.readouterr().err
    main(["validate", str(run_dir)])
    assert str(segment) in capsys.readouterr().out


def test_report_names_a_run_duckdb_it_could_not_open(tmp_path, capsys):
    """A `run.duckdb` beside the segments that cannot be attached (locked by another
    process, or not a database) leaves its rows out: `query` said so, `report` did not."""
    from trainspec.store.layout import COMPACT_NAME

    run_dir = make_dashboard_run(tmp_path / "run", ranks=2, seconds=4.0)
    (run_dir / COMPACT_NAME).write_bytes(b"not a database" * 100)
    assert main(["query", str(run_dir), "SELECT 1"]) == 0
    (expected,) = _warnings(capsys.readouterr().err, "query")
    assert main(["report", str(run_dir), "--png", str(tmp_path / "png")]) == 0
    (line,) = _warnings(capsys.readouterr().err, "report")
    assert str(run_dir / COMPACT_NAME) in line
    assert line.split(": warning: ", 1)[1] == expected.split(": warning: ", 1)[1]
