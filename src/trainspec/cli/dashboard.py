"""`trainspec dashboard [RUN_ROOT] [STREAMLIT_OPTION ...]`: the live Streamlit dashboard.

Options after the runs root go to `streamlit run` unchanged (`--server.port 8601
--server.headless true`). Without a root, put `--` before them: `trainspec dashboard --
--server.port 8601` shows ./runs. It listens on 127.0.0.1 only, as the Prometheus endpoint
and the agent do, unless the user names an address: `--server.address 0.0.0.0`,
STREAMLIT_SERVER_ADDRESS, or `address` under [server] in a .streamlit/config.toml.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from trainspec.cli.child import run_job
from trainspec.cli.main import CliError
from trainspec.cli.run_path import existing_directory

DEFAULT_ROOT = "runs"
# No usage statistics leave the machine unless the user asks (later options win).
STREAMLIT_DEFAULTS = ["--browser.gatherUsageStats", "false"]
# Streamlit alone listens on every interface; the runs are not for the network to read
# unless the user names an address.
LOOPBACK = ["--server.address", "127.0.0.1"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?", default=DEFAULT_ROOT,
        help="directory of runs (or one run directory), default ./runs",
    )  # fmt: skip
    parser.add_argument(
        "streamlit_args", nargs=argparse.REMAINDER, metavar="STREAMLIT_OPTION",
        help="passed to `streamlit run`, e.g. --server.port 8601 --server.headless true; "
        "listens on 127.0.0.1 unless given --server.address (0.0.0.0: every interface)",
    )  # fmt: skip


def streamlit_command(root: str, streamlit_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `streamlit run` command line and environment for a runs root."""
    passthrough = list(streamlit_args)
    if root.startswith("-"):  # `trainspec dashboard -- --server.port 1`: no root was given
        passthrough.insert(0, root)
        root = DEFAULT_ROOT
    passthrough = [a for a in passthrough if a != "--"]
    _check_server_options(passthrough)
    path = existing_directory(root)
    from trainspec.dashboards import __file__ as package_init

    app = Path(package_init).with_name("app.py")
    env = dict(os.environ, TRAINSPEC_DASHBOARD_ROOT=str(path.resolve()))
    defaults = STREAMLIT_DEFAULTS + ([] if _names_address(passthrough, env) else LOOPBACK)
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), *defaults, *passthrough]
    return cmd, env


def _option(streamlit_args: list[str], flag: str) -> str | None:
    """The value given for `flag` (`--flag X` or `--flag=X`), the last one winning."""
    value = None
    for i, arg in enumerate(streamlit_args):
        if arg == flag and i + 1 < len(streamlit_args):
            value = streamlit_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _check_server_options(streamlit_args: list[str]) -> None:
    """A port or address Streamlit cannot bind is one line here, not its traceback."""
    import socket

    port = _option(streamlit_args, "--server.port")
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise CliError(f"--server.port {port}: must be a port in 1-65535")
    address = _option(streamlit_args, "--server.address")
    if address is not None:
        try:
            socket.getaddrinfo(address, None)
        except (OSError, UnicodeError) as exc:
            raise CliError(f"--server.address {address}: not an address here ({exc})") from exc


def _names_address(streamlit_args: list[str], env: dict[str, str]) -> bool:
    """Whether the user chose the address: `--server.address X`, `--server.address=X`,
    Streamlit's variable or its config files (a command-line option would override those)."""
    flag = "--server.address"
    if any(a == flag or a.startswith(flag + "=") for a in streamlit_args):
        return True
    if "STREAMLIT_SERVER_ADDRESS" in env:
        return True
    files = (Path.home() / ".streamlit/config.toml", Path(".streamlit/config.toml"))
    return any(_config_address(f) for f in files)


def _config_address(path: Path) -> bool:
    """Whether a Streamlit config file sets [server] address; an unreadable one is Streamlit's
    to report."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    try:
        server = tomllib.loads(path.read_text()).get("server")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(server, dict) and "address" in server


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None:
        raise CliError("streamlit is not installed: pip install 'trainspec[dashboard]'")
    cmd, env = streamlit_command(args.root, args.streamlit_args)
    print(f"trainspec dashboard: {env['TRAINSPEC_DASHBOARD_ROOT']}", flush=True)
    # SIGTERM, SIGHUP and SIGINT reach Streamlit too: a `kill` of this process alone left
    # it serving the port.
    return run_job(cmd, env)
