"""The agent's settings: defaults < TOML file (`--config`) < `TRAINSPEC_AGENT_*` env < flags.

A bind address other than loopback is refused unless `allow_remote` is set AND a bearer
token is configured: the control API can checkpoint or reconfigure a job, so it is never
exposed by accident. A `TRAINSPEC_AGENT_<NAME>` naming no setting logs one warning (with
the closest name, if one is close) and the agent starts anyway, as the ranks do for
`TRAINSPEC_*` (`trainspec.config`); the rank side's own `agent` section (`endpoint`,
`timeout_s`, `retry_after_s`) shares the prefix and is not warned about.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainspec.config import (
    AgentConfig,
    Rule,
    TrainspecConfig,
    coerce,
    seconds,
    values_from_env,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("trainspec.agent")
ENV_PREFIX = "TRAINSPEC_AGENT_"
# The ranks' `agent` section (trainspec.config.AgentConfig) reads these from the same prefix.
RANK_SIDE_KEYS = frozenset(f.name for f in dataclasses.fields(AgentConfig))
RANK_SIDE_ENV = frozenset(ENV_PREFIX + key.upper() for key in RANK_SIDE_KEYS)
DEFAULT_PORT = 4318  # the OTLP/HTTP port, so OTEL_EXPORTER_OTLP_ENDPOINT finds the agent
_AT_LEAST_ONE = Rule("must be >= 1", lambda v: v >= 1)
RULES: dict[str, Rule] = {  # an interval of 0 (or nan) spins a thread; a limit of 0 refuses all
    "max_body_bytes": _AT_LEAST_ONE,
    "commit_interval_s": seconds(0, above=True),
    "forward_buffer": _AT_LEAST_ONE,
    "pending_rows": _AT_LEAST_ONE,
    # As the ranks' collector.interval_s: below 10 ms the node sampler takes a core.
    "node_interval_s": seconds(0.01),
    "metrics_max_series": _AT_LEAST_ONE,
    "metrics_series_ttl_s": seconds(0, above=True),
}


class SettingsError(ValueError):
    """A setting is wrong; the message names it."""


@dataclass
class AgentSettings:
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    store: str = "runs"  # runs root: each run's segments under <store>/<run id>
    allow_remote: bool = False  # required (with a token) for a non-loopback bind
    token: str = ""  # bearer token; also read from token_file or TRAINSPEC_AGENT_TOKEN
    token_file: str = ""
    upstream: str = ""  # OTLP/HTTP base URL to forward to ("" = no forwarding)
    forward_buffer: int = 1000  # requests held while upstream is down; beyond: oldest dropped
    max_body_bytes: int = 16 * 1024 * 1024  # after decompression too
    commit_interval_s: float = 0.25  # group commit: one segment per table per run per cycle
    pending_rows: int = 2_000_000  # rows waiting for a commit; beyond: 503, the rank writes
    node_interval_s: float = 0.05
    metrics_max_series: int = 20_000  # series /metrics holds; beyond, new ones are dropped
    metrics_series_ttl_s: float = 300.0  # a series unchanged this long leaves /metrics
    nvml: bool = True
    node_id: str = ""  # writer id suffix; default: host name

    @property
    def node(self) -> str:
        """This node's name in the store: `node_id`, else the host name."""
        return self.node_id or socket.gethostname()

    @property
    def writer_id(self) -> str:
        """The store's writer id of this node's agent (agent/writer.py)."""
        return f"agent-{self.node}"

    @property
    def host(self) -> str:
        return _split(self.listen)[0]

    def address(self, port: int) -> str:
        """HOST:PORT as a URL takes it: an IPv6 host in brackets."""
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    @property
    def port(self) -> int:
        return _split(self.listen)[1]

    def resolved_token(self) -> str:
        """The bearer token: `token`, else the contents of `token_file`, else "" (none).
        `load_settings` keeps only the one of the two set at the highest layer, and reads
        `TRAINSPEC_AGENT_TOKEN` into `token` at the environment layer."""
        if self.token.strip():  # as the ranks read it: a trailing newline dropped
            return _bearer(self.token, f"token ({ENV_PREFIX}TOKEN)")
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise SettingsError(f"token_file {self.token_file}: {exc.strerror}") from exc
            except UnicodeDecodeError as exc:
                raise SettingsError(
                    f"token_file {self.token_file}: not text ({exc.reason})"
                ) from exc
            if not token:  # else the agent would run unauthenticated without a word
                raise SettingsError(f"token_file {self.token_file}: is empty")
            return _bearer(token, f"token_file {self.token_file}")
        return ""


def _bearer(value: str, setting: str) -> str:
    """The token as every side reads it (`bearer_token`); one no header can carry exits 2
    naming `setting`, never the value."""
    from trainspec.collector.sinks.otlp_auth import TokenError, bearer_token

    try:
        return bearer_token(value, setting)
    except TokenError as exc:
        raise SettingsError(str(exc)) from None


def _split(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(f"listen {listen!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(
    path: str | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> AgentSettings:
    """Build and check the settings; SettingsError names the first wrong one."""
    env = os.environ if environ is None else environ
    settings = AgentSettings()
    types = {f.name: {"str": str, "int": int, "float": float, "bool": bool}[str(f.type)]
             for f in dataclasses.fields(settings)}  # fmt: skip
    layers: list[tuple[str, dict[str, Any]]] = []
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise SettingsError(f"config file {path} not found") from exc
        except OSError as exc:  # a directory, not readable
            raise SettingsError(f"config file {path}: {exc.strerror}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SettingsError(f"config file {path}: {exc}") from exc
        table = _agent_table(path, data)
        # The ranks' keys in one node-level file ([agent] endpoint, timeout_s, ...) are theirs.
        layers.append((path, {k: v for k, v in table.items() if k not in RANK_SIDE_KEYS}))
    layers.append(("environment", _from_env(env, types)))
    layers.append(("flag", {k: v for k, v in (overrides or {}).items() if v is not None}))
    for origin, values in layers:
        for key, value in values.items():
            if key not in types:
                raise SettingsError(f"{origin}: unknown setting {key}")
            setattr(settings, key, coerce(value, types[key], f"{origin}: {key}", SettingsError))
        _one_token_source(settings, origin, values)
    check(settings)
    return settings


# The ranks' own config sections (trainspec.config.TrainspecConfig) besides [agent].
RANK_SECTIONS = frozenset(f.name for f in dataclasses.fields(TrainspecConfig)) - {"agent"}


def _agent_table(path: str, data: dict[str, Any]) -> dict[str, Any]:
    """The agent's keys of a TOML file: its `[agent]` table. A file without one is either
    the ranks' node-level file (only their sections: the agent takes its defaults) or the
    older flat form (the agent's keys at the top level, still read)."""
    if "agent" in data:
        table = data["agent"]
        if not isinstance(table, dict):
            raise SettingsError(f"config file {path}: [agent] is not a table")
        return table
    return {k: v for k, v in data.items() if not (k in RANK_SECTIONS and isinstance(v, dict))}


def _one_token_source(settings: AgentSettings, origin: str, values: dict[str, Any]) -> None:
    """`token` and `token_file` are one setting from two sources: the one a layer sets
    overrides the other from a lower layer (a `--token-file` flag beats
    `TRAINSPEC_AGENT_TOKEN`). One layer setting both is ambiguous and refused."""
    token, token_file = bool(values.get("token")), bool(values.get("token_file"))
    if token and token_file:
        raise SettingsError(f"{origin}: token and token_file are both set; set one")
    if token:
        settings.token_file = ""
    elif token_file:
        settings.token = ""


def _from_env(env: Mapping[str, str], keys: Collection[str]) -> dict[str, str]:
    """The `TRAINSPEC_AGENT_<KEY>` values; warns once per name that is no setting (the ranks'
    own agent-client names excepted)."""
    return values_from_env(
        env, ENV_PREFIX, keys, ignore=RANK_SIDE_ENV, logger=log, who="trainspec-agent"
    )


def check(settings: AgentSettings) -> None:
    """Refuse unsafe or impossible settings."""
    host = settings.host
    token = settings.resolved_token()  # a token file that cannot be read is refused, always
    if Path(settings.store).exists() and not Path(settings.store).is_dir():
        raise SettingsError(f"store {settings.store}: not a directory")
    if not is_loopback(host):
        if not settings.allow_remote:
            raise SettingsError(
                f"listen {settings.listen}: a non-loopback bind needs --allow-remote and a token"
            )
        if not token:
            raise SettingsError(
                f"listen {settings.listen}: a non-loopback bind needs a bearer token "
                "(--token-file or TRAINSPEC_AGENT_TOKEN)"
            )
    for key, rule in RULES.items():
        value = getattr(settings, key)
        if not rule.holds(value):
            raise SettingsError(f"{key}: {value!r} {rule.text}")
    if settings.upstream:
        _check_upstream(settings.upstream)
    _check_writer_id(settings)
    _check_store(settings.store)


def _check_upstream(upstream: str) -> None:
    """An http(s)://HOST[:PORT][/PATH] URL the forwarder can POST to: else every request
    would fail on the forward thread, long after the agent said it started."""
    problem = ""
    try:
        url = urlsplit(upstream)
        port = url.port  # ValueError for a port that is no number or out of range
    except ValueError as exc:
        problem = str(exc)
    else:
        if url.scheme not in ("http", "https"):
            problem = "not an http(s) URL"
        elif not url.hostname:
            problem = "no host"
        elif port == 0:
            problem = "port 0"
        elif any(c <= " " or c == "\x7f" for c in upstream):
            problem = "spaces or control characters"
        elif url.query or url.fragment:
            problem = "a query or fragment (the agent appends /v1/metrics)"
    if problem:
        raise SettingsError(f"upstream {upstream!r} is not an http(s)://HOST[:PORT] URL: {problem}")


def _check_writer_id(settings: AgentSettings) -> None:
    """The store's rule for a writer id (store/segments.py, SegmentWriter): a plain,
    non-hidden file name, here `agent-<node>`; else every commit would fail."""
    writer = settings.writer_id
    if "/" in writer or "\0" in writer or len(os.fsencode(writer)) > 255:
        raise SettingsError(
            f"node_id {settings.node!r}: the writer id {writer!r} must be a plain file name "
            "(no '/', at most 255 bytes)"
        )


def _check_store(store: str) -> None:
    """The runs root must be a directory this process can write, or one it can create: the
    nearest existing part of the path decides, and nothing is made here (the writer makes
    the directories as it stores)."""
    path = Path(store).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        why = "is not a directory" if existing == path else f"{existing} is not a directory"
        raise SettingsError(f"store {store}: cannot create: {why}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingsError(f"store {store}: {existing} is not writable")
