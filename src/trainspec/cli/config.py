"""`trainspec config`: print the whole configuration, after TOML and TRAINSPEC_* are applied."""

from __future__ import annotations

import argparse

from trainspec.cli.main import CliError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", help="TOML file (default: $TRAINSPEC_CONFIG)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of TOML")


def run(args: argparse.Namespace) -> int:
    from trainspec.config import ConfigError, load_config, render_toml
    from trainspec.levels import LEVEL_RULES

    try:
        cfg = load_config(args.file, extra_rules=LEVEL_RULES)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    print(cfg.to_json() if args.json else render_toml(cfg))
    return 0
