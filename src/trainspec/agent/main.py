"""`trainspec-agent`: run the node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from trainspec.agent.settings import SettingsError, load_settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="trainspec-agent", description="trainspec per-node sidecar agent"
    )
    p.add_argument("--config", help="TOML file ([agent] table)")
    p.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:4318)")
    p.add_argument("--store", help="runs root directory (default ./runs)")
    p.add_argument("--upstream", help="OTLP/HTTP base URL to forward ranks' OTLP to")
    p.add_argument("--allow-remote", action="store_true", default=None,
                   help="permit a non-loopback --listen (a token is then required)")  # fmt: skip
    p.add_argument("--token-file", help="file holding the bearer token for the control API")
    p.add_argument("--no-nvml", dest="nvml", action="store_false", default=None)
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    overrides = {
        "listen": args.listen,
        "store": args.store,
        "upstream": args.upstream,
        "allow_remote": args.allow_remote,
        "token_file": args.token_file,
        "nvml": args.nvml,
    }
    try:
        settings = load_settings(args.config, overrides=overrides)
    except SettingsError as exc:
        print(f"trainspec-agent: {exc}", file=sys.stderr)
        return 2
    from trainspec.agent.app import Agent

    try:
        agent = Agent(settings)
    except OSError as exc:
        print(f"trainspec-agent: cannot listen on {settings.listen}: {exc}", file=sys.stderr)
        return 1
    agent.start()
    print(f"trainspec-agent: listening on {settings.address(agent.port)}, store {settings.store}",
          flush=True)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
