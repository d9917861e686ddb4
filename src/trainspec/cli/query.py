"""`trainspec query RUN "SQL"`: SQL against a run's views, printed as a table, CSV or JSON."""

from __future__ import annotations

import argparse

import duckdb

from trainspec.cli.main import CliError
from trainspec.cli.output import render_csv, render_json, render_text, warn_skipped
from trainspec.cli.run_path import run_location


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory or its run.duckdb")
    parser.add_argument("sql", help='SQL over samples, steps, events, runs, e.g. "SELECT ..."')
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV")
    fmt.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of rows; NaN and infinities, which JSON lacks, are the strings "
        '"NaN", "Infinity" and "-Infinity" (null is SQL NULL)',
    )


def _no_statement(sql: str) -> bool:
    """Whether `sql` parses to no statement at all (a syntax error is the query's to report)."""
    try:
        return not duckdb.extract_statements(sql)
    except duckdb.Error:
        return False


def run(args: argparse.Namespace) -> int:
    from trainspec.store import StoreError, query_with_skipped
    from trainspec.store.errors import first_line

    if _no_statement(args.sql):  # "", ";" or a comment: an empty line and exit 0 said nothing
        raise CliError(f"no SQL statement in {args.sql!r}")
    try:
        table, skipped = query_with_skipped(run_location(args.run), args.sql)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
    except duckdb.Error as exc:
        raise CliError(f"SQL failed: {first_line(exc)}") from exc
    warn_skipped("query", skipped)
    render = render_csv if args.csv else render_json if args.json else render_text
    # CSV ends each row with its own line break: print's would add an empty line
    print(render(table), end="" if args.csv else "\n")
    return 0
