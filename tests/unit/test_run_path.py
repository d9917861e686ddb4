"""The path a command is given: `RUN/run.duckdb` names its run, compacted or not, and a path
no command can use is one of three lines, the same in every command (`cli/run_path.py`)."""

from __future__ import annotations

import json

import pytest

import trainspec.store as store
from tests.helpers.cli import one_line_error
from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main
from trainspec.store.tables import to_arrow

COUNT_SQL = "SELECT count(*) AS n FROM steps"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """A report that is written by mistake lands here, not in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A live run (segments only), a compacted one, a file, and a directory with no run."""
    root = tmp_path_factory.mktemp("runs")
    live = make_compliant_run(root / "live", ranks=1, seconds=1.0)
    compacted = make_compliant_run(root / "compacted", ranks=1, seconds=1.0)
    store.compact(compacted)
    (root / "afile").write_text("not a run\n")
    (root / "empty").mkdir()
    return root, live, compacted


def _count(capsys, run: str) -> int:
    assert main(["query", run, COUNT_SQL, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)[0]["n"]


@pytest.mark.parametrize("which", ["live", "compacted"])
def test_query_of_a_run_s_store_file_reads_its_run(runs, capsys, which):
    """`RUN/run.duckdb` of a run not compacted yet said "no such run directory"."""
    run = runs[1] if which == "live" else runs[2]
    assert _count(capsys, str(run / "run.duckdb")) == _count(capsys, str(run)) > 0


@pytest.mark.parametrize("which", ["live", "compacted"])
def test_validate_of_a_run_s_store_file_judges_its_run(runs, capsys, which):
    run = runs[1] if which == "live" else runs[2]
    assert main(["validate", str(run / "run.duckdb")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run} (run, ") and "COMPLIANT" in out, out


def test_a_compacted_run_s_store_file_reads_the_steps_stored_since(tmp_path, capsys):
    """A job restarted after a compaction appends segments: the store file names the run,
    and the run is every row, not the file's alone."""
    run = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    store.compact(run)
    last = store.query(run, "SELECT * FROM steps ORDER BY step DESC LIMIT 1").to_pylist()[0]
    late = dict(last, step=last["step"] + 1, ts=last["ts"] + 1.0)
    store.SegmentWriter(run, "steps", "rank-0-late").write(
        to_arrow("steps", {k: [v] for k, v in late.items()})
    )
    in_file = store.query(run / "run.duckdb", COUNT_SQL).column(0)[0].as_py()
    assert _count(capsys, str(run / "run.duckdb")) == in_file + 1


# (command, extra arguments): every command that takes one run
RUN_COMMANDS = [
    ("query", [COUNT_SQL]),
    ("validate", []),
    ("report", ["--html", "unused.html"]),
    ("compact", []),
]


@pytest.mark.parametrize(("command", "extra"), RUN_COMMANDS)
def test_a_missing_run_does_not_exist(runs, capsys, command, extra):
    path = runs[0] / "nope"
    err = one_line_error(capsys, main([command, str(path), *extra]))
    assert err == f"trainspec {command}: error: {path} does not exist"


@pytest.mark.parametrize(("command", "extra"), RUN_COMMANDS)
def test_a_missing_run_s_store_file_does_not_exist(runs, capsys, command, extra):
    path = runs[0] / "nope" / "run.duckdb"
    err = one_line_error(capsys, main([command, str(path), *extra]))
    assert err == f"trainspec {command}: error: {path} does not exist"


@pytest.mark.parametrize(("command", "extra"), RUN_COMMANDS)
def test_a_directory_with_no_run_is_not_a_trainspec_run(runs, capsys, command, extra):
    path = runs[0] / "empty"
    err = one_line_error(capsys, main([command, str(path), *extra]))
    assert err == (
        f"trainspec {command}: error: {path} is not a trainspec run "
        "(no segments/ and no run.duckdb)"
    )


@pytest.mark.parametrize(("command", "extra"), [c for c in RUN_COMMANDS if c[0] != "validate"])
def test_a_file_is_not_a_directory(runs, capsys, command, extra):
    """(`validate` reads a file as an exposition or OTLP payload.)"""
    path = runs[0] / "afile"
    err = one_line_error(capsys, main([command, str(path), *extra]))
    assert err == f"trainspec {command}: error: {path} is not a directory"


@pytest.mark.parametrize(
    ("name", "said"), [("nope", "does not exist"), ("afile", "is not a directory")]
)
def test_dashboard_says_which_a_runs_root_is_not(runs, capsys, name, said):
    """A file was "no such runs directory", as a path that did not exist was."""
    path = runs[0] / name
    err = one_line_error(capsys, main(["dashboard", str(path)]))
    assert err == f"trainspec dashboard: error: {path} {said}"


def test_compact_of_a_run_s_store_file_folds_its_run(tmp_path, capsys):
    run = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    assert main(["compact", str(run / "run.duckdb")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"compacted into {run / 'run.duckdb'}")
    assert (run / "run.duckdb").is_file()
