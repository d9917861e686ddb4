"""Validity rules: a bad environment value warns and keeps the default, a bad TOML value raises."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

import trainspec
from trainspec.config import FOREIGN_ENV, ConfigError, TrainspecConfig, load_config
from trainspec.config_rules import RULES

DEFAULTS = TrainspecConfig()


def _get(cfg: TrainspecConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _var(key: str) -> str:
    return "TRAINSPEC_" + key.replace(".", "_").upper()


BAD = [
    ("collector.interval_s", "0"),
    ("collector.interval_s", "-1"),
    ("collector.interval_s", "nan"),
    ("collector.interval_s", "inf"),
    ("collector.interval_s", "1e-9"),  # passed before: the sampler would spin on a core
    ("store.flush_interval_s", "0.001"),  # 4,000 segment files a second
    ("store.flush_interval_s", "0"),
    ("store.flush_interval_s", "-5"),
    ("collector.queue_capacity", "-1"),
    ("collector.queue_capacity", "0"),
    ("store.merge_fanout", "1"),
    ("store.merge_fanout", "0"),
    ("collector.prometheus_port", "70000"),
    ("collector.prometheus_port", "-1"),
    ("collector.otel", "maybe"),
    ("collector.mode", "sidecars"),
    ("collector.probe_timeout_s", "0"),
    ("collector.peak_flops", "-1"),
    ("collector.thread_nice", "-3"),
    ("agent.timeout_s", "0"),
    ("agent.timeout_s", "0.5"),
    ("agent.retry_after_s", "-1"),
    # Past a day: a wait refuses more than threading.TIMEOUT_MAX with OverflowError, which
    # lost a sidecar rank every batch (agent.timeout_s) and killed the flush thread.
    ("agent.timeout_s", "1e10"),
    ("agent.retry_after_s", "1e300"),
    ("store.flush_interval_s", "1e300"),
    ("collector.interval_s", "86401"),
    ("collector.probe_timeout_s", "1e10"),
    ("kernels.int8_block_size", "0"),
    ("kernels.int8_block_size", "67108864"),
    ("actuator.window_steps", "0"),
    ("actuator.patience", "0"),
    ("actuator.straggler_score", "1.5"),
    ("actuator.rebalance_max_change", "0"),
    ("actuator.loss_spike_factor", "1"),
    ("actuator.memory_pressure", "nan"),
    ("actuator.micro_batch", "-1"),
    ("actuator.min_micro_batch", "0"),
    # Out of order: the compression policy's "lower compression" turned int8 on.
    ("actuator.compression_ladder", "int8,none"),
    ("actuator.compression_ladder", "none,lowrank:2,int8"),
    ("actuator.compression_ladder", "none,int8:64,int8:256,int8:32"),
    ("actuator.compression_ladder", "none,bf16,bf16"),
    ("checkpoint.keep_last", "0"),
    ("checkpoint.mtbf_gpu_hours", "0"),
]


@pytest.mark.parametrize("key, value", BAD)
def test_bad_environment_value_warns_naming_variable_value_rule_and_keeps_default(
    caplog, key, value
):
    var = _var(key)
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        cfg = load_config(environ={var: value})
    assert _get(cfg, key) == _get(DEFAULTS, key)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert var in lines[0] and repr(value) in lines[0] and RULES[key].text in lines[0]


def test_bad_environment_value_keeps_the_toml_value(tmp_path, caplog):
    path = tmp_path / "t.toml"
    path.write_text("[collector]\ninterval_s = 0.5\n")
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        cfg = load_config(path, environ={"TRAINSPEC_COLLECTOR_INTERVAL_S": "0"})
    assert cfg.collector.interval_s == 0.5
    assert "TRAINSPEC_COLLECTOR_INTERVAL_S" in caplog.text


def _toml(value: str) -> str:
    try:
        float(value)
    except ValueError:
        return f'"{value}"'
    return value


@pytest.mark.parametrize("key, value", BAD)
def test_bad_toml_value_raises_naming_file_key_and_rule(tmp_path, key, value):
    section, name = key.split(".")
    path = tmp_path / "t.toml"
    path.write_text(f"[{section}]\n{name} = {_toml(value)}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert str(path) in message and key in message and RULES[key].text in message


def test_bad_override_raises():
    with pytest.raises(ConfigError, match="store.merge_fanout"):
        load_config(environ={}, overrides={"store": {"merge_fanout": 1}})


GOOD = [
    ("collector.interval_s", "0.01", 0.01),  # the floor: a faster sampler takes a core
    ("store.flush_interval_s", "30", 30.0),
    ("collector.queue_capacity", "1", 1),
    ("store.merge_fanout", "2", 2),
    ("collector.prometheus_port", "0", 0),
    ("collector.prometheus_port", "65535", 65535),
    ("collector.otel", "on", "on"),
    ("collector.otel", "off", "off"),
    ("collector.mode", "sidecar", "sidecar"),
    ("collector.peak_flops", "0", 0.0),
    ("collector.thread_nice", "10", 10),
    ("agent.retry_after_s", "0", 0.0),
    ("actuator.straggler_exit_score", "1", 1.0),  # the edge of (0, 1]
    ("actuator.micro_batch", "0", 0),
    ("actuator.rebalance_cooldown", "0", 0),
    ("checkpoint.keep_last", "1", 1),
    (
        "actuator.compression_ladder",
        "none,bf16,int8,lowrank:4,lowrank:2",
        "none,bf16,int8,lowrank:4,lowrank:2",
    ),
    # a plain int8 is the job's block, unknown to the rule
    ("actuator.compression_ladder", "none,int8:64,int8", "none,int8:64,int8"),
    ("actuator.compression_ladder", "bf16,topk:0.01", "bf16,topk:0.01"),
]


@pytest.mark.parametrize("key, value, expected", GOOD)
def test_valid_values_pass_from_environment_and_toml(tmp_path, caplog, key, value, expected):
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        assert _get(load_config(environ={_var(key): value}), key) == expected
    assert not caplog.records
    section, name = key.split(".")
    path = tmp_path / "t.toml"
    path.write_text(f"[{section}]\n{name} = {_toml(value)}\n")
    assert _get(load_config(path, environ={}), key) == expected


def test_defaults_satisfy_every_rule_and_every_rule_names_a_field():
    fields = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(DEFAULTS)
        for f in dataclasses.fields(getattr(DEFAULTS, s.name))
    }
    assert set(RULES) <= fields
    for key, rule in RULES.items():
        assert rule.holds(_get(DEFAULTS, key)), key


def test_unknown_environment_name_warns_once_with_the_closest_name(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        cfg = load_config(environ={"TRAINSPEC_COLLECTOR_INTREVAL_S": "1"})
    assert cfg.collector.interval_s == DEFAULTS.collector.interval_s
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "TRAINSPEC_COLLECTOR_INTREVAL_S" in lines[0]
    assert "TRAINSPEC_COLLECTOR_INTERVAL_S" in lines[0]


def test_unknown_environment_name_without_a_close_one_still_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        load_config(environ={"TRAINSPEC_STORE_XYZZY": "1"})
    assert "TRAINSPEC_STORE_XYZZY" in caplog.text and "did you mean" not in caplog.text


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("TRAINSPEC_COLECTOR_INTERVAL_S", "TRAINSPEC_COLLECTOR_INTERVAL_S"),  # the section
        ("TRAINSPEC_ACTUATR_PATIENCE", "TRAINSPEC_ACTUATOR_PATIENCE"),
        ("TRAINSPEC_INJCT", "TRAINSPEC_INJECT"),  # a name read elsewhere
        ("TRAINSPEC_XYZZY", None),
    ],
)
def test_unknown_section_in_the_environment_warns_once(caplog, name, closest):
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        cfg = load_config(environ={name: "1"})
    assert cfg == DEFAULTS
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and name in lines[0], lines
    if closest:
        assert lines[0].endswith(f"did you mean {closest}?"), lines
    else:
        assert "did you mean" not in lines[0]


def test_no_name_the_code_reads_is_warned_about(caplog):
    """Every `TRAINSPEC_*` literal under src/ (the agent's and the collector's included)."""
    src = Path(trainspec.__file__).parent
    names = {
        name
        for path in src.rglob("*.py")
        for name in re.findall(r"\bTRAINSPEC_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert {"TRAINSPEC_ACTUATOR", "TRAINSPEC_AUTO", "TRAINSPEC_INJECT"} <= names
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        load_config(environ=dict.fromkeys(names - {"TRAINSPEC_CONFIG"}, "1"))
    warned = [r.getMessage() for r in caplog.records if "no such setting" in r.getMessage()]
    assert not warned, warned


def test_variables_read_elsewhere_are_not_warned_about(caplog):
    environ = {
        "TRAINSPEC_ACTUATOR": "off",
        "TRAINSPEC_INJECT": "kill:rank=1",
        "TRAINSPEC_ALLOW_INJECT": "1",
        "TRAINSPEC_CONFIG": "",
        "TRAINSPEC_AUTO": "1",
        "TRAINSPEC_DASHBOARD_ROOT": "runs",
        "TRAINSPEC_ARTIFACTS": "/tmp",
        "TRAINSPEC_STORE_ROOT": "runs",
        "TRAINSPEC_STORE_RUN_ID": "r1",
        **{name: "x" for name in FOREIGN_ENV},
    }
    with caplog.at_level(logging.WARNING, logger="trainspec.config"):
        load_config(environ=environ)
    assert not caplog.records, caplog.text


def test_foreign_names_cover_the_agent_daemons_settings():
    from trainspec.agent.settings import AgentSettings
    from trainspec.config import AgentConfig

    ours = {f.name for f in dataclasses.fields(AgentConfig)}
    theirs = {f.name for f in dataclasses.fields(AgentSettings)} | {"token"}
    missing = {f"TRAINSPEC_AGENT_{k.upper()}" for k in theirs - ours} - FOREIGN_ENV
    assert not missing, f"add {sorted(missing)} to trainspec.config.FOREIGN_ENV"


def test_prometheus_port_past_65535_degrades_to_a_warning(tmp_path, caplog):
    from trainspec.collector.sinks.store import StoreSink
    from trainspec.runtime.identity import RankIdentity
    from trainspec.runtime.wiring import build_sinks

    cfg = load_config(environ={})
    cfg.collector.prometheus_port = 65535  # valid base port; local rank 1 makes it 65536
    cfg.collector.otel = "off"
    ident = RankIdentity(rank=1, local_rank=1, world_size=2, host="h")
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        sinks, store = build_sinks(cfg, ident, tmp_path, {"trainspec.run.id": "r"})
    try:
        assert sinks == [store] and isinstance(store, StoreSink)
        assert "65536" in caplog.text
    finally:
        store.close()


def test_the_prometheus_endpoint_listens_on_the_configured_address(tmp_path, caplog):
    from tests.integration.jobs import free_port
    from trainspec.runtime.identity import RankIdentity
    from trainspec.runtime.wiring import build_sinks

    cfg = load_config(environ={"TRAINSPEC_COLLECTOR_PROMETHEUS_ADDR": "0.0.0.0"})
    cfg.collector.prometheus_port = free_port()
    cfg.collector.otel = "off"
    ident = RankIdentity(rank=0, local_rank=0, world_size=1, host="h")
    sinks, store = build_sinks(cfg, ident, tmp_path, {"trainspec.run.id": "r"})
    try:
        (prom,) = [s for s in sinks if s is not store]
        assert prom._server.server_address[0] == "0.0.0.0"
    finally:
        for sink in sinks:
            sink.close()
    cfg.collector.prometheus_addr = "no-such-host.invalid"
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        sinks, store = build_sinks(cfg, ident, tmp_path, {"trainspec.run.id": "r"})
    store.close()
    assert sinks == [store] and "no-such-host.invalid" in caplog.text


def test_a_ladder_out_of_order_is_one_line_naming_it_with_the_level_rules_too(tmp_path):
    """The grammar's rule (trainspec/levels.py) replaced this module's for the same key."""
    from trainspec.levels import LEVEL_RULES

    toml = tmp_path / "c.toml"
    toml.write_text('[actuator]\ncompression_ladder = "int8,none"\n')
    with pytest.raises(ConfigError) as info:
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)
    message = str(info.value)
    assert "\n" not in message and "actuator.compression_ladder" in message
    assert "'int8,none'" in message and "least to most compressed" in message
    toml.write_text('[actuator]\ncompression_ladder = "int9,none"\n')  # the grammar first
    with pytest.raises(ConfigError, match="must be levels separated by commas"):
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)


@pytest.mark.parametrize(
    ("var", "bad", "key"),
    [
        ("TRAINSPEC_KERNELS_COMPRESSION", "bogus", "kernels.compression"),
        ("TRAINSPEC_KERNELS_COMPRESSION", "lowrank:0", "kernels.compression"),
        ("TRAINSPEC_ACTUATOR_COMPRESSION_LADDER", "none,int9", "actuator.compression_ladder"),
    ],
)
def test_a_bad_compression_level_from_the_environment_warns_and_keeps_the_default(
    var, bad, key, caplog, tmp_path
):
    from trainspec.levels import LEVEL_RULES

    with caplog.at_level(logging.WARNING, logger="trainspec"):
        cfg = load_config(environ={var: bad}, extra_rules=LEVEL_RULES)
    section, field = key.split(".")
    assert getattr(getattr(cfg, section), field) == getattr(
        getattr(TrainspecConfig(), section), field
    )
    assert var in caplog.text and bad in caplog.text
    toml = tmp_path / "c.toml"
    toml.write_text(f'[{section}]\n{field} = "{bad}"\n')
    with pytest.raises(ConfigError, match=key):
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)
    good = "lowrank-bf16:12:3:exact" if field == "compression" else "none,lowrank:4"
    cfg = load_config(environ={var: good}, extra_rules=LEVEL_RULES)
    assert getattr(getattr(cfg, section), field) == good


def test_whole_numbers_written_as_floats_are_still_whole_numbers(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[checkpoint]\nkeep_last = 3.0\n")
    assert load_config(toml, environ={}).checkpoint.keep_last == 3


@pytest.mark.parametrize(
    ("env", "first", "second"),
    [
        (
            {"TRAINSPEC_ACTUATOR_STRAGGLER_SCORE": "0.95"},
            "actuator.straggler_score",
            "actuator.straggler_exit_score",
        ),
        (
            {"TRAINSPEC_ACTUATOR_REBALANCE_FOLLOW_MIN_GAIN": "0.9"},
            "actuator.rebalance_follow_min_gain",
            "actuator.rebalance_min_gain",
        ),
        (
            {"TRAINSPEC_ACTUATOR_MIN_MICRO_BATCH": "8", "TRAINSPEC_ACTUATOR_MICRO_BATCH": "4"},
            "actuator.micro_batch",
            "actuator.min_micro_batch",
        ),
    ],
)
def test_contradicting_variables_warn_and_keep_the_values_before_them(
    env, first, second, caplog, tmp_path
):
    defaults = TrainspecConfig()
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        cfg = load_config(environ=env)
    for key in (first, second):
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == getattr(getattr(defaults, section), name)
    assert first in caplog.text and second in caplog.text
    # The same contradiction written in the file is an error naming both fields.
    toml = tmp_path / "c.toml"
    lines = [f"{k.split('_', 2)[2].lower()} = {v}" for k, v in env.items()]
    toml.write_text("[actuator]\n" + "\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=f"{first}.*{second}"):
        load_config(toml, environ={})


def test_a_variable_that_resolves_a_contradiction_in_the_file_is_kept(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[actuator]\nmin_micro_batch = 8\nmicro_batch = 16\n")
    cfg = load_config(toml, environ={"TRAINSPEC_ACTUATOR_MICRO_BATCH": "32"})
    assert (cfg.actuator.micro_batch, cfg.actuator.min_micro_batch) == (32, 8)


def test_one_node_level_file_serves_the_ranks_and_the_agent(tmp_path):
    """Each side refused the other's keys in [agent]: `trainspec config --file agent.toml`
    failed on `listen`, the agent on `endpoint`."""
    from pathlib import Path

    from trainspec.agent.settings import SettingsError, load_settings

    shipped = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "agent.toml"
    assert load_config(shipped, environ={}).agent.endpoint == ""  # the agent's file: read
    node = tmp_path / "node.toml"
    node.write_text('[agent]\nlisten = "127.0.0.1:4999"\nendpoint = "http://127.0.0.1:4999"\n'
                    "timeout_s = 7.0\n")  # fmt: skip
    assert load_config(node, environ={}).agent.timeout_s == 7.0
    assert load_settings(node, environ={}).listen == "127.0.0.1:4999"
    node.write_text("[agent]\nlisen = 1\n")  # a typo is still an error on both sides
    with pytest.raises(ConfigError, match="unknown key agent.lisen"):
        load_config(node, environ={})
    with pytest.raises(SettingsError, match="unknown setting lisen"):
        load_settings(node, environ={})
