"""A run whose data is damaged behind readable Parquet footers, with a `run.duckdb` beside its
segments (every demo run has one): each reader says so in one line and exits 2. They printed
a duckdb traceback and exited 1, which `validate` means as "not compliant"."""

from __future__ import annotations

import pytest

from tests.helpers.runs import make_compliant_run
from trainspec.cli.main import main
from trainspec.store import compact


@pytest.fixture
def damaged_run(tmp_path):
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=2.0)
    compact(run_dir)
    segment = sorted((run_dir / "segments" / "samples").rglob("seg-*.parquet"))[0]
    data = bytearray(segment.read_bytes())
    data[60:400] = bytes(b ^ 0x5A for b in data[60:400])  # pages, not the footer
    segment.write_bytes(bytes(data))
    return run_dir


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{run}"],
        ["report", "{run}", "--html", "{tmp}/r.html"],
        ["query", "{run}", "SELECT count(*) FROM samples"],
    ],
)
def test_damaged_data_is_named_and_the_rest_answers(damaged_run, tmp_path, capsys, argv):
    """Damage behind a readable footer costs the damaged segment, named, not the whole run
    (it was exit 2 for the run until 2026-11-25)."""
    args = [a.format(run=damaged_run, tmp=tmp_path) for a in argv]
    assert main(args) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    assert "seg-0000000000-0000000000.parquet" in text
    assert "damaged" in text or "unreadable" in text


def test_compacting_damaged_data_is_one_line_and_exit_2(damaged_run, capsys):
    assert main(["compact", str(damaged_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("trainspec compact: error:") and "seg-0000000000" in err


def test_an_unforeseen_error_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import trainspec.store.compliance as compliance

    def broken(target):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(compliance, "validate_target", broken)
    target = tmp_path / "metrics.prom"  # a path validate takes: the error is the bug's
    target.write_text("")
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "trainspec validate: error: unexpected ZeroDivisionError: a bug "
        "(TRAINSPEC_DEBUG=1 shows the traceback)"
    )
    monkeypatch.setenv("TRAINSPEC_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["validate", str(target)])


def test_report_names_a_damaged_run_duckdb_as_the_other_readers_do(tmp_path, capsys):
    """`query`, `validate` and the dashboard said so; `report` printed only its file."""
    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=2.0)
    compact(run_dir)
    base = run_dir / "run.duckdb"
    base.write_bytes(base.read_bytes()[: base.stat().st_size // 2])
    for path in (run_dir / "segments" / "samples").rglob("seg-*.parquet"):
        path.unlink()  # rows only the compacted file held
    assert main(["report", str(run_dir), "--html", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert "run.duckdb" in err and "Traceback" not in err


def test_a_damaged_segment_of_a_compacted_run_is_not_said_to_lose_its_rows(damaged_run, capsys):
    """The compacted file held them and the answer had every step; the warning said the
    rows were missing."""
    assert main(["query", str(damaged_run), "SELECT count(*) FROM steps"]) == 0
    assert "unless run.duckdb holds them" in capsys.readouterr().err
    (damaged_run / "run.duckdb").unlink()
    assert main(["query", str(damaged_run), "SELECT count(*) FROM steps"]) == 0
    err = capsys.readouterr().err
    assert "its rows are missing from the result" in err and "unless" not in err
