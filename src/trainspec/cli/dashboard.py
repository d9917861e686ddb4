"""`trainspec dashboard [RUN_ROOT] [STREAMLIT_OPTION ...]`: the live Streamlit dashboard.

Options after the runs root go to `streamlit run` unchanged (`--server.port 8601
--server.headless true`). Without a root, put `--` before them: `trainspec dashboard --
--server.port 8601` shows ./runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from trainspec.cli.main import CliError

DEFAULT_ROOT = "runs"
# No usage statistics leave the machine unless the user asks (later options win).
STREAMLIT_DEFAULTS = ["--browser.gatherUsageStats", "false"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?", default=DEFAULT_ROOT,
        help="directory of runs (or one run directory), default ./runs",
    )  # fmt: skip
    parser.add_argument(
        "streamlit_args", nargs=argparse.REMAINDER, metavar="STREAMLIT_OPTION",
        help="passed to `streamlit run`, e.g. --server.port 8601 --server.headless true",
    )  # fmt: skip


def streamlit_command(root: str, streamlit_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `streamlit run` command line and environment for a runs root."""
    passthrough = list(streamlit_args)
    if root.startswith("-"):  # `trainspec dashboard -- --server.port 1`: no root was given
        passthrough.insert(0, root)
        root = DEFAULT_ROOT
    passthrough = [a for a in passthrough if a != "--"]
    path = Path(root)
    if not path.is_dir():
        raise CliError(f"{root}: no such runs directory")
    from trainspec.dashboards import __file__ as package_init

    app = Path(package_init).with_name("app.py")
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), *STREAMLIT_DEFAULTS, *passthrough]
    env = dict(os.environ, TRAINSPEC_DASHBOARD_ROOT=str(path.resolve()))
    return cmd, env


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None:
        raise CliError("streamlit is not installed: pip install 'trainspec[dashboard]'")
    cmd, env = streamlit_command(args.root, args.streamlit_args)
    print(f"trainspec dashboard: {env['TRAINSPEC_DASHBOARD_ROOT']}", flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode
