"""One configuration tree for trainspec: a section per package, from TOML or `TRAINSPEC_*`.

Precedence: explicit argument (`load_config(overrides=...)`), then the environment
(`TRAINSPEC_<SECTION>_<FIELD>`, e.g. `TRAINSPEC_COLLECTOR_INTERVAL_S=0.1`), then the TOML
file (`TRAINSPEC_CONFIG` or the `path` argument), then the defaults below. An invalid
environment value (not of the field's type, or breaking its rule in `config_rules.py`) logs a
one-line warning naming the variable and keeps the lower-precedence value (as the
OpenTelemetry SDK does), so a typo in a job's environment never takes the job down; so does a
`TRAINSPEC_<SECTION>_<NAME>` that names no field of a known section, and a `TRAINSPEC_*` name
of no section that no other part of trainspec reads (`ELSEWHERE_ENV`). An invalid TOML file or
override raises `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import logging
import os
import stat
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainspec.config_rules import PAIR_RULES, Rule, pair_violation, violation
from trainspec.config_rules import seconds as seconds  # the agent's settings use it too

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it."""


@dataclass
class StoreConfig:
    root: str = "runs"  # runs root; each run is a directory under it
    run_id: str = ""  # empty: generated at init (shared by all ranks through torchrun's env)
    flush_interval_s: float = 2.0
    merge_fanout: int = 16
    # unflushed rows also appended to a journal file as they arrive, so a killed process
    # loses at most one sampling tick of them (store/journal.py)
    journal: bool = True


@dataclass
class CollectorConfig:
    enabled: bool = True
    interval_s: float = 0.05  # sampling interval for sources that support it
    queue_capacity: int = 100_000  # points buffered between flushes; beyond: dropped, counted
    probe: bool = True  # collective latency probe on a side gloo group
    probe_timeout_s: float = 10.0
    nvml: bool = True
    otel: str = "auto"  # auto: on when OTEL_EXPORTER_OTLP_ENDPOINT is set; on | off
    prometheus_port: int = 0  # 0: off; else base port, rank's port = base + local_rank
    # the address the ranks' /metrics listen on: loopback by default; 0.0.0.0 (or the
    # node's address) for a Prometheus server on another host or a pod scrape
    prometheus_addr: str = "127.0.0.1"
    peak_flops: float = 0.0  # per device; 0: MFU not reported
    mode: str = "embedded"  # embedded: this rank writes its store | sidecar: via trainspec-agent
    # sampler and flush threads run this much nicer than training (Linux, per thread); 0: the
    # same. Off by default: on the 2-core benchmark it made no difference beyond the noise
    # (docs/collector.md, "Overhead").
    thread_nice: int = 0
    # at the end of set-up, collect garbage once and freeze what is left (gc.freeze): the
    # cyclic collector's full passes then skip set-up's objects (torch's, pyarrow's, ...),
    # which otherwise stall a step for 100-200 ms the first time one runs (runtime/init.py)
    gc_freeze: bool = True


@dataclass
class AgentConfig:
    """How a rank in sidecar mode reaches its node's trainspec-agent (docs/agent.md)."""

    endpoint: str = ""  # empty: OTEL_EXPORTER_OTLP_ENDPOINT, else http://127.0.0.1:4318
    timeout_s: float = 5.0  # per batch; past it the rank writes the batch itself
    retry_after_s: float = 10.0  # after a failure, write locally this long before trying again


@dataclass
class KernelsConfig:
    # none | bf16 | int8 | lowrank:R | lowrank:R:W (W int8 steps first) | lowrank:R:W:exact
    # (W exact steps first) | lowrank-bf16:R[:W[:exact]] | topk:F (0 < F <= 1)
    compression: str = "none"
    int8_block_size: int = 256


@dataclass
class ActuatorConfig:
    enabled: bool = True  # TRAINSPEC_ACTUATOR=off also switches it off (kill switch)
    dry_run: bool = False  # detect and advise (events), change nothing
    window_steps: int = 5  # summaries are gathered and decided on every this many steps
    patience: int = 3  # windows a condition must hold before anything happens (hysteresis)
    straggler_score: float = 0.8  # enter: best per-sample time / this rank's below this
    straggler_exit_score: float = 0.9  # leave: score back at or above this
    rebalance: bool = True
    rebalance_min_gain: float = 0.1  # act only for a predicted step-time gain above this
    rebalance_follow_min_gain: float = 0.015  # ... or this, for the one quick same-way follow-up
    rebalance_max_change: float = 0.75  # per decision, at most this x (global batch / ranks)
    rebalance_cooldown: int = 0  # windows to wait after a rebalance (patience restarts too)
    min_share: int = 1  # samples a rank always keeps
    compression: bool = True  # the compression-level policy
    # least to most compressed, checked at two ranks; at the job's world size the policy
    # skips a rung that sends no fewer bytes than one before it (int8 from 4 ranks on)
    compression_ladder: str = "none,bf16,int8"
    comm_bound_share: float = 0.3  # exposed all-reduce share of the step that is "bound"
    input_bound_share: float = 0.2  # data-wait share of the step that is "bound"
    accordion_eta: float = 0.5  # critical regime: relative gradient-norm change above this
    loss_spike_factor: float = 1.5
    latency_spike_factor: float = 3.0  # probe window median above this x its baseline ...
    latency_spike_floor_s: float = 0.002  # ... and above the baseline by at least this
    memory_pressure: float = 0.92
    memory: bool = True  # the memory policy: shrink the micro-batch under pressure
    micro_batch: int = 0  # samples per micro-batch; 0: the rank's whole share (no accumulation)
    min_micro_batch: int = 1  # the memory policy and OOM retries never go below this
    memory_cooldown: int = 2  # windows after pressure cleared (past patience) before growing
    checkpoint: bool = True  # Young/Daly and on-anomaly checkpoints (needs a callback)


@dataclass
class CheckpointConfig:
    dir: str = ""  # where ts.actuate() checkpoints when not given checkpoint_dir; empty: nowhere
    keep_last: int = 3
    mtbf_gpu_hours: float = 50_000.0  # per-GPU mean time between failures


@dataclass
class TrainspecConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    actuator: ActuatorConfig = field(default_factory=ActuatorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def coerce(value: Any, target: type, key: str, error: type[ValueError] = ConfigError) -> Any:
    """`value` (from TOML or an environment variable) as `target`; `error` names `key`."""
    if target is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise error(f"{key}: {value!r} is not a boolean")
    # TOML gives typed values: a number where text belongs, or true / 1.5 where a whole
    # number belongs, is a mistake to name rather than to convert (root = 5, keep_last = 1.5).
    if target is str and not isinstance(value, str):
        raise error(f"{key}: {value!r} is not a string")
    if target is int and (
        isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())
    ):
        raise error(f"{key}: {value!r} is not a whole number")
    try:
        return target(value)
    except (TypeError, ValueError) as exc:
        raise error(f"{key}: {value!r} is not {_a(target.__name__)}") from exc


def _a(noun: str) -> str:
    """`noun` with its indefinite article: "an int", "a float"."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _field_types(section: Any) -> dict[str, type]:
    types = {"str": str, "int": int, "float": float, "bool": bool}
    return {f.name: types[str(f.type)] for f in dataclasses.fields(section)}


def _apply(
    cfg: TrainspecConfig,
    data: dict[str, Any],
    origin: str,
    strict: bool,
    rules: dict[str, Rule] | None = None,
) -> None:
    """Set `data` on `cfg`; a bad value raises (strict) or, from the environment, warns."""
    for section_name, values in data.items():
        # by field name: getattr alone would take `to_dict = 3` for a section
        sections = {f.name for f in dataclasses.fields(cfg)}
        section = getattr(cfg, section_name) if section_name in sections else None
        if section is None:
            raise ConfigError(f"{origin}: unknown section [{section_name}]")
        if not isinstance(values, dict):  # `collector = 3`: the section is named, not a table
            kind = type(values).__name__
            raise ConfigError(f"{origin}: [{section_name}] must be a table, got {kind}")
        types = _field_types(section)
        for key, value in values.items():
            full = f"{section_name}.{key}"
            if section_name == "agent" and key not in types and key.upper() in AGENT_OWN_KEYS:
                continue  # trainspec-agent's own setting, in one node-level file with ours
            if key not in types:
                raise ConfigError(f"{origin}: unknown key {full}")
            try:
                coerced = coerce(value, types[key], full)
                broken = violation(full, coerced, rules)
                if broken is not None:
                    raise ConfigError(f"{full}: {value!r} {broken}")
                setattr(section, key, coerced)
            except ConfigError as exc:
                if strict:
                    raise ConfigError(f"{origin}: {exc}") from exc
                log.warning(
                    "trainspec: ignoring %s (%s); keeping %r",
                    _env_name(section_name, key),
                    exc,
                    getattr(section, key),
                )


# Names under a section's prefix that other code reads: trainspec-agent's own settings
# (agent/settings.py, `TRAINSPEC_AGENT_<KEY>`) and the bearer token. Not warned about.
AGENT_OWN_KEYS = frozenset(
    (
        "LISTEN",
        "STORE",
        "ALLOW_REMOTE",
        "TOKEN",
        "TOKEN_FILE",
        "UPSTREAM",
        "FORWARD_BUFFER",
        "MAX_BODY_BYTES",
        "COMMIT_INTERVAL_S",
        "PENDING_ROWS",
        "NODE_INTERVAL_S",
        "METRICS_MAX_SERIES",
        "METRICS_SERIES_TTL_S",
        "NVML",
        "NODE_ID",
    )
)
FOREIGN_ENV = frozenset("TRAINSPEC_AGENT_" + key for key in AGENT_OWN_KEYS)


# `TRAINSPEC_*` names outside every section that other code reads: not warned about.
ELSEWHERE_ENV = frozenset(
    {
        "TRAINSPEC_CONFIG",  # this module: the TOML file
        "TRAINSPEC_ACTUATOR",  # kill_switch_on below: the actuator's kill switch
        "TRAINSPEC_INJECT",  # runtime/inject.py: staged faults ...
        "TRAINSPEC_ALLOW_INJECT",  # ... and their opt-in
        "TRAINSPEC_AUTO",  # runtime/autoload: `trainspec run`'s ranks instrument themselves
        "TRAINSPEC_RUN_PID",  # ... as does the one process `trainspec run -- python ...` starts
        "TRAINSPEC_DASHBOARD_ROOT",  # dashboards/app.py: the runs root `trainspec dashboard` set
        "TRAINSPEC_ARTIFACTS",  # .ci/run and the integration tests: where screenshots go
        "TRAINSPEC_DEBUG",  # cli/main.py: show the traceback of an unforeseen error
    }
)
ENV_PREFIX = "TRAINSPEC_"


def _env_name(section: str, key: str) -> str:
    return f"TRAINSPEC_{section.upper()}_{key.upper()}"


def values_from_env(
    environ: Mapping[str, str],
    prefix: str,
    keys: Collection[str],
    *,
    ignore: Collection[str] = (),
    logger: logging.Logger | None = None,
    who: str = "trainspec",
) -> dict[str, str]:
    """`<prefix><KEY>` values for `keys` from `environ`; any other name under the prefix (but
    those in `ignore`, which belong to someone else) is warned about once and left out,
    naming the closest setting when one is close."""
    found: dict[str, str] = {}
    for env_key in sorted(k for k in environ if k.startswith(prefix)):
        key = env_key[len(prefix) :].lower()
        if key in keys:
            found[key] = environ[env_key]
        elif env_key not in ignore:
            close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.7)
            hint = f"; did you mean {prefix}{close[0].upper()}?" if close else ""
            (logger or log).warning("%s: ignoring %s: no such setting%s", who, env_key, hint)
    return found


def _from_env(cfg: TrainspecConfig, environ: dict[str, str]) -> dict[str, dict[str, str]]:
    """The `TRAINSPEC_<SECTION>_<FIELD>` values; warns once per unknown name of a section,
    and once per `TRAINSPEC_*` name of no section that nothing else reads."""
    found: dict[str, dict[str, str]] = {}
    names = set(ELSEWHERE_ENV)  # every name read, for the closest one to a misspelt section
    for f in dataclasses.fields(cfg):
        keys = list(_field_types(getattr(cfg, f.name)))
        names.update(_env_name(f.name, key) for key in keys)
        values = values_from_env(environ, _env_name(f.name, ""), keys, ignore=FOREIGN_ENV)
        if values:
            found[f.name] = values
    sections = tuple(_env_name(f.name, "") for f in dataclasses.fields(cfg))
    unknown = [k for k in environ if k.startswith(ENV_PREFIX) and not k.startswith(sections)]
    # the names after the prefix, as values_from_env compares them: the prefix is no likeness
    values_from_env(
        {k: environ[k] for k in unknown},
        ENV_PREFIX,
        [n.removeprefix(ENV_PREFIX).lower() for n in sorted(names)],
        ignore=ELSEWHERE_ENV,
    )
    return found


def load_config(
    path: str | Path | None = None,
    *,
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: dict[str, str] | None = None,
    extra_rules: dict[str, Rule] | None = None,
) -> TrainspecConfig:
    """Build the configuration: defaults < TOML < environment < overrides.

    `extra_rules` adds value rules this module cannot state without importing the package
    that owns the grammar (the runtime and the CLI pass the level grammar: trainspec/levels.py)."""
    environ = dict(os.environ if environ is None else environ)
    cfg = TrainspecConfig()
    toml_path = path or environ.get("TRAINSPEC_CONFIG")
    if toml_path:
        try:
            data = tomllib.loads(_read_config_text(Path(toml_path)))
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {toml_path} not found") from exc
        except OSError as exc:  # a directory, not readable
            raise ConfigError(f"config file {toml_path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {toml_path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {toml_path}: {exc}") from exc
        _apply(cfg, data, str(toml_path), strict=True, rules=extra_rules)
    before_env = cfg.to_dict()
    found = _from_env(cfg, environ)
    for section, values in found.items():
        _apply(cfg, {section: values}, "environment", strict=False, rules=extra_rules)
    if overrides:
        _apply(cfg, overrides, "argument", strict=True, rules=extra_rules)
    from_env = {f"{s}.{k}" for s, values in found.items() for k in values}
    from_env -= {f"{s}.{k}" for s, values in (overrides or {}).items() for k in values}
    _check_pairs(cfg, before_env, from_env, str(toml_path or "argument"))
    if kill_switch_on(environ):
        cfg.actuator.enabled = False  # `trainspec config` shows what the job will do
    return cfg


# A configuration file is a few KB: past this it is not one (`--file /dev/zero` read without
# end, a FIFO blocked for ever).
MAX_CONFIG_BYTES = 1 << 20
KILL_SWITCH = "TRAINSPEC_ACTUATOR"
_SWITCH_OFF = ("off", "0", "false", "no", "disabled", "disable")
_SWITCH_ON = ("", "on", "1", "true", "yes", "enabled", "enable")


def kill_switch_on(environ: dict[str, str] | None = None) -> bool:
    """Whether `TRAINSPEC_ACTUATOR` switches the actuator off. A value that is neither on
    nor off is off, with a warning: a kill switch errs on its safe side (`disabled` was
    read as on, without a word)."""
    value = (os.environ if environ is None else environ).get(KILL_SWITCH, "").strip().lower()
    if value in _SWITCH_ON:
        return False
    if value not in _SWITCH_OFF and value not in _warned_switch:
        _warned_switch.add(value)
        log.warning("trainspec: %s=%r is neither on nor off: the actuator is off (the kill "
                    "switch's safe side); say off or on", KILL_SWITCH, value)  # fmt: skip
    return True


_warned_switch: set[str] = set()


def _read_config_text(path: Path) -> str:
    """The file's text, at most MAX_CONFIG_BYTES of it (`/dev/zero` was read without end).
    A pipe (`--file <(...)`, `/dev/stdin`) and `/dev/null` are read as files are; opened
    without blocking, so a FIFO nobody writes reads as empty instead of waiting for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        os.set_blocking(fd, True)  # a pipe's writer may not have written yet
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise OSError(f"larger than {MAX_CONFIG_BYTES // 1024} KiB: not a configuration file")
    return b"".join(chunks).decode("utf-8")


def _check_pairs(
    cfg: TrainspecConfig, before_env: dict[str, Any], from_env: set[str], origin: str
) -> None:
    """Constraints between two fields (`PAIR_RULES`): a breach that a variable brought in is
    a warning and that variable's value is dropped; one the file or arguments made raises."""

    def get(key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    for rule in PAIR_RULES:
        broken = pair_violation(rule, get)
        if broken is None:
            continue
        blamed = [k for k in (rule.first, rule.second) if k in from_env]
        if not blamed:
            raise ConfigError(f"{origin}: {broken}")
        for key in blamed:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, before_env[section][name])
        names = " and ".join(_env_name(*k.split(".")) for k in blamed)
        log.warning("trainspec: ignoring %s (%s); keeping the values before them", names, broken)
        still = pair_violation(rule, get)
        if still is not None:
            raise ConfigError(f"{origin}: {still}")


def render_toml(cfg: TrainspecConfig) -> str:
    """The whole configuration as TOML (what `trainspec config` prints)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
