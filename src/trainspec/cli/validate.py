"""`trainspec validate TARGET [--json] [--strict] [--by-rank]`: judge a run, exposition or
OTLP payload.

Exit 0 when compliant, 1 when not, 2 when the target cannot be read (one line saying why).
The text lists a violation shared by several ranks once, with its ranks as ranges
(`trainspec.schema.groups`); `--by-rank` lists every violation on its own line, as `--json`
always does. A warning (a segment that could not be read, say) leaves a run compliant on
what could be read; `--strict`, for CI gates, fails it with exit 1 as well. A note (a
scrape's cadence not judged, an agent's own metrics left out) is printed and fails nothing,
`--strict` included: every such target has it. Imports neither torch nor the exporters.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainspec.cli.main import CliError
from trainspec.cli.run_path import run_location


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        help="run directory, run.duckdb, Prometheus exposition file or http(s) URL, "
        "or OTLP metrics payload file (protobuf or JSON)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 1) on warnings too, such as a segment that could not be read "
        "(notes, such as a scrape's cadence not judged, never fail)",
    )
    parser.add_argument(
        "--by-rank",
        action="store_true",
        help="one line per violation and rank, instead of one per metric and rule shared "
        "by several ranks (--json always lists every violation)",
    )


def run(args: argparse.Namespace) -> int:
    from trainspec.schema.targets import TargetError
    from trainspec.store.compliance import validate_target

    if not args.target.strip():  # "" was read as the current directory, "."
        raise CliError("TARGET is empty: name a run directory, run.duckdb, file or URL")
    try:
        report = validate_target(_run_or_payload(args.target))
    except TargetError as exc:
        raise CliError(str(exc)) from exc
    report.strict = args.strict
    print(report.render_json() if args.json else report.render_text(by_rank=args.by_rank))
    return 0 if report.passed else 1


def _run_or_payload(target: str) -> str:
    """A URL or an exposition or payload file as given; anything else names a run, which
    `run_location` finds (`RUN/run.duckdb` is its run) or says in one line why not."""
    path = Path(target)
    if target.startswith(("http://", "https://")):
        return target
    if path.exists() and not path.is_dir() and path.suffix != ".duckdb":
        return target  # not a regular file, maybe: a FIFO or /dev/stdin reads as one
    return str(run_location(target))
