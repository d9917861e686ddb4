"""`trainspec report RUN [--html FILE | --png DIR]`: the dashboard's plots, without a server."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory or run.duckdb")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--html", metavar="FILE", help="one self-contained HTML file")
    out.add_argument("--png", metavar="DIR", help="one PNG per plot in this directory")


def run(args: argparse.Namespace) -> int:
    for module in ("matplotlib", "pandas"):
        if importlib.util.find_spec(module) is None:
            raise CliError(f"{module} is not installed: pip install 'trainspec[dashboard]'")
    from trainspec.cli.output import warn_skipped
    from trainspec.cli.run_path import run_location
    from trainspec.dashboards.report import render_report
    from trainspec.store import StoreError, unreadable_segments

    for flag, value in (("--html", args.html), ("--png", args.png)):
        if value is not None and not value.strip():  # "" was the current directory
            raise CliError(f"{flag} needs a path, got an empty one")
    run = run_location(args.run)
    html = args.html
    if html is None and args.png is None:  # default: an HTML file named after the run
        html = f"report-{run.resolve().name}.html"
    try:
        written = render_report(run, html=html, png_dir=args.png)
        # listed after the report's reads: damage behind a readable footer is found only by
        # reading
        skipped = _skipped(run, unreadable_segments)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"cannot write the report: {exc}") from exc
    warn_skipped("report", skipped)
    for path in written:
        print(path)
    return 0


def _skipped(run: Path, unreadable_segments) -> list[tuple[str, str]]:
    """What the report's reader left out, as `trainspec query` lists it: the segments the
    listing refuses, and what a reader's connection leaves out on opening, a `run.duckdb`
    beside the segments that cannot be attached (locked by another process, or not a
    database). The listing alone missed the latter, and the report said nothing."""
    import duckdb

    from trainspec import store

    skipped = list(unreadable_segments(run))
    try:
        con = store.open(run)
    except (store.StoreError, duckdb.Error):
        return skipped  # the report itself read the run: what it could not, it said
    try:
        opened = store.skipped_segments(con)
    finally:
        con.close()
    seen = {path for path, _ in skipped}
    return skipped + [(str(path), reason) for path, reason in opened if str(path) not in seen]
