"""Entry point of the `trainspec` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module under trainspec.cli, one-line help). Modules load only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "train the reference GPT on N ranks with trainspec, validate, summarise"),
    "run": ("run", "run a command (torchrun ...) with trainspec injected, no script change"),
    "config": ("config", "print the whole configuration (TOML + TRAINSPEC_* applied)"),
    "query": ("query", "run SQL against a run's tables (samples, steps, events, runs)"),
    "compact": ("compact", "fold a run's segments into one run.duckdb"),
    "validate": ("validate", "check a run, exposition or OTLP payload against the catalogue"),
    "schema": ("schema", "print the metric catalogue (--markdown renders docs/SPEC.md)"),
    "dashboard": ("dashboard", "live Streamlit dashboard over a directory of runs"),
    "report": ("report", "headline plots of a run as HTML or PNG files, no server"),
}


class CliError(Exception):
    """Bad input to a command: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainspec",
        description="One standard set of metrics for PyTorch training jobs, and a closed loop "
        "that acts on them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Arguments are added lazily below, only for the command being run or helped.
    return parser


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    name = next((a for a in argv if not a.startswith("-")), None)
    module = None
    if name in COMMANDS:
        module = importlib.import_module(f"trainspec.cli.{COMMANDS[name][0]}")
        module.configure(_command_parser(parser, name))
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return int(module.run(args))
    except CliError as exc:
        print(f"trainspec {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `trainspec query ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug or an error no command foresaw: one line, and exit 2,
        # never 1, which `validate` gives a non-compliant target
        if os.environ.get("TRAINSPEC_DEBUG"):
            raise
        reason = str(exc).splitlines()[0] if str(exc) else ""
        print(f"trainspec {name}: error: unexpected {type(exc).__name__}: {reason} "
              "(TRAINSPEC_DEBUG=1 shows the traceback)", file=sys.stderr)  # fmt: skip
        return 2


if __name__ == "__main__":
    # Run as `python -m trainspec.cli.main`, this file is `__main__`: dispatch through the
    # package module, so the CliError the commands raise is the one caught above.
    from trainspec.cli.main import main as _entry

    sys.exit(_entry())
