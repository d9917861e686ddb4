"""`trainspec compact RUN`: fold the run's segments into one run.duckdb (idempotent)."""

from __future__ import annotations

import argparse
import sys

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory (or its run.duckdb)")
    parser.add_argument(
        "--skip-unreadable",
        action="store_true",
        help="compact even when some segments cannot be read (their rows are left out)",
    )


def run(args: argparse.Namespace) -> int:
    from trainspec.cli.output import warn_skipped
    from trainspec.cli.run_path import run_location
    from trainspec.store import StoreError
    from trainspec.store.compact import compact_run

    try:
        done = compact_run(run_location(args.run), skip_unreadable=args.skip_unreadable)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
    warn_skipped("compact", done.skipped)
    if done.set_aside is not None:
        print(
            f"trainspec compact: warning: the unreadable {done.target.name} it replaced is "
            f"kept as {done.set_aside}",
            file=sys.stderr,
        )
    if done.salvaged.total:
        print(f"stored {done.salvaged.total} journaled rows no flush had stored (a process "
              "killed, or a flush that failed)")  # fmt: skip
    for path, why in done.salvaged.unreadable:
        print(f"trainspec compact: warning: journal file {path} left as it is: {why}",
              file=sys.stderr)  # fmt: skip
    print(f"compacted into {done.target}")
    return 0
