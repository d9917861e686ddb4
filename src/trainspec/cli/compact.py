"""`trainspec compact RUN`: fold the run's segments into one run.duckdb (idempotent)."""

from __future__ import annotations

import argparse

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory")


def run(args: argparse.Namespace) -> int:
    from trainspec.store import StoreError, compact

    try:
        target = compact(args.run)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
    print(f"compacted into {target}")
    return 0
