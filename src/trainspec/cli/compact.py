"""`trainspec compact RUN`: fold the run's segments into one run.duckdb (idempotent)."""

from __future__ import annotations

import argparse

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument(
        "--skip-unreadable",
        action="store_true",
        help="compact even when some segments cannot be read (their rows are left out)",
    )


def run(args: argparse.Namespace) -> int:
    from trainspec.store import StoreError, compact

    try:
        target = compact(args.run, skip_unreadable=args.skip_unreadable)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
    print(f"compacted into {target}")
    return 0
