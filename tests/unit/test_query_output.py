"""`trainspec query`'s table keeps epoch-second timestamps apart; its CSV loses no digit."""

from __future__ import annotations

import csv
import io
import json
import math

import pyarrow as pa
import pytest

from trainspec.cli.main import main
from trainspec.cli.output import render_csv, render_json, render_text

# Three steps 1 ms apart, at a 2026 epoch time: `%g` wrote all three as 1.79556e+09.
TS = [1795565408.979, 1795565408.980, 1795565408.981]


def _column(text: str, name: str) -> list[str]:
    header, _rule, *rows = text.splitlines()
    at = header.split().index(name)
    return [row.split()[at] for row in rows]


def test_table_timestamps_keep_milliseconds():
    shown = _column(render_text(pa.table({"ts": TS})), "ts")
    assert shown == ["1795565408.979", "1795565408.980", "1795565408.981"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.0618739417, "0.0618739"),  # ordinary values keep 6 significant digits
        (5.5519404, "5.55194"),
        (1e-9, "1e-09"),
        (99999.5, "99999.5"),
        (123456.789, "123456.789"),  # from 1e5 up, every integer digit
        (1882136.0, "1882136"),  # a whole count has no decimals
        (-1795565408.5, "-1795565408.500"),
        (1e20, "1e+20"),  # no milliseconds in a double that large: the exponent is honest
        (float("nan"), "nan"),
        (float("inf"), "inf"),
    ],
)
def test_table_floats(value, shown):
    assert _column(render_text(pa.table({"v": [value]})), "v") == [shown]


def test_csv_floats_read_back_as_the_same_doubles():
    values = [*TS, 0.1 + 0.2, 1e-300]
    rows = list(csv.reader(io.StringIO(render_csv(pa.table({"v": values})))))
    assert [float(r[0]) for r in rows[1:]] == values


def test_query_table_tells_a_runs_timestamps_apart(tmp_path, capsys):
    from tests.helpers.runs import make_compliant_run

    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    sql = "SELECT DISTINCT ts FROM samples ORDER BY ts LIMIT 5"
    assert main(["query", str(run_dir), sql]) == 0
    shown = _column(capsys.readouterr().out, "ts")
    assert len(shown) == 5 and len(set(shown)) == 5, shown


def test_query_csv_ends_with_its_last_row(tmp_path, capsys):
    """print() added its newline after the CSV's own line break: an empty last line."""
    from tests.helpers.runs import make_compliant_run

    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    assert main(["query", str(run_dir), "SELECT 1 AS a, 2 AS b", "--csv"]) == 0
    out = capsys.readouterr().out
    assert out == "a,b\r\n1,2\r\n"
    assert main(["query", str(run_dir), "SELECT 1 AS a"]) == 0
    assert capsys.readouterr().out.endswith("1\n")


@pytest.mark.parametrize("compacted", [False, True])
def test_query_reads_the_run_s_files_only(tmp_path, capsys, compacted):
    """A SELECT could read any file the user can (`read_text`, `glob`, `read_csv`); the
    connection is confined to the run's directory (the configuration locked; SET is refused
    as any statement but a SELECT is)."""
    from tests.helpers.runs import make_compliant_run
    from trainspec.store import compact

    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    if compacted:
        compact(run_dir)
    target = str(run_dir / "run.duckdb") if compacted else str(run_dir)
    assert main(["query", target, "SELECT count(*) AS n FROM steps"]) == 0
    assert int(_column(capsys.readouterr().out, "n")[0]) > 0
    for sql in (f"SELECT * FROM read_text('{secret}')", f"SELECT * FROM glob('{tmp_path}/*')"):
        assert main(["query", target, sql]) == 2, sql
        err = capsys.readouterr().err
        assert "do not read" not in err and err.count("\n") == 1, err


def _strict_json(text: str) -> object:
    """`json.loads` takes bare NaN and Infinity, which no strict parser (jq, a browser) does."""

    def refuse(token: str) -> object:
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_query_json_keeps_nan_and_infinities_apart_from_null(tmp_path, capsys):
    """All three were null, as a SQL NULL is: a loss that went NaN read as a missing loss."""
    from tests.helpers.runs import make_compliant_run

    run_dir = make_compliant_run(tmp_path / "run", ranks=1, seconds=1.0)
    sql = (
        "SELECT 'nan'::DOUBLE AS nan, 'inf'::DOUBLE AS inf, '-inf'::REAL AS ninf, "
        "NULL::DOUBLE AS missing, 0.25::DOUBLE AS finite, ['-inf'::DOUBLE, 2.0] AS l, "
        "{'v': 'nan'::DOUBLE} AS s"
    )
    assert main(["query", str(run_dir), sql, "--json"]) == 0
    doc = _strict_json(capsys.readouterr().out)
    assert doc == [
        {
            "nan": "NaN",
            "inf": "Infinity",
            "ninf": "-Infinity",
            "missing": None,
            "finite": 0.25,
            "l": ["-Infinity", 2.0],
            "s": {"v": "NaN"},
        }
    ]


def test_json_non_finite_strings_read_back_as_the_same_doubles():
    values = [math.nan, math.inf, -math.inf, 1e308, -0.0]
    (row,) = _strict_json(render_json(pa.table({"v": [values]})))
    back = [float(v) for v in row["v"]]
    assert math.isnan(back[0]) and back[1:] == values[1:]
