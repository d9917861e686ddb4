"""`trainspec schema [--markdown]`: print the metric catalogue, or render docs/SPEC.md."""

from __future__ import annotations

import argparse

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print the specification as Markdown (SPEC.md)"
    )
    parser.add_argument(
        "--prometheus", action="store_true", help="show Prometheus names instead of OTel names"
    )


def run(args: argparse.Namespace) -> int:
    from trainspec.schema import load_catalogue
    from trainspec.schema.markdown import render_markdown, render_table

    if args.markdown and args.prometheus:  # SPEC.md shows both names: one was ignored
        raise CliError("--markdown and --prometheus do not combine: SPEC.md shows both names")
    catalogue = load_catalogue()
    if args.markdown:
        print(render_markdown(catalogue), end="")
    else:
        print(render_table(catalogue, prometheus=args.prometheus))
    return 0
