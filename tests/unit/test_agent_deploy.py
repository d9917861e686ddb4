"""The deployment examples agree with the agent: YAML parses, ports, endpoints, store roots and
settings are the ones the agent and the ranks actually use."""

from __future__ import annotations

import configparser
import dataclasses
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from trainspec.agent.main import parse_args
from trainspec.agent.settings import DEFAULT_PORT, AgentSettings, load_settings
from trainspec.collector.sinks.agent import agent_endpoint
from trainspec.config import load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
AGENT_TOML = DEPLOY / "systemd" / "agent.toml"
COMMENTED_KEY = re.compile(r"^#\s*(\w+\s*=.*)$")  # "# token = ''  # why": a key not forced


def _pod() -> dict:
    return yaml.safe_load((DEPLOY / "kubernetes" / "trainer-with-agent.yaml").read_text())


def _containers() -> dict[str, dict]:
    spec = _pod()["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def test_pod_completes_when_training_ends_and_the_agent_sees_the_gpus():
    """The agent was a plain container that never exits: a restartPolicy: Never pod (and its
    8 GPUs) stayed Running after the trainer finished. It is a native sidecar (an init
    container with restartPolicy: Always, Kubernetes >= 1.29), stopped after the trainer."""
    spec = _pod()["spec"]
    assert spec["restartPolicy"] == "Never"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]  # the pod ends with it
    sidecars = [c for c in spec["initContainers"] if c.get("restartPolicy") == "Always"]
    assert [c["name"] for c in sidecars] == ["trainspec-agent"]
    text = (DEPLOY / "kubernetes" / "trainer-with-agent.yaml").read_text()
    assert "1.29" in text  # the version the form needs is said
    agent, trainer = _containers()["trainspec-agent"], _containers()["trainer"]
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"  # NVML sees every GPU of the node
    assert "utility" in env.get("NVIDIA_DRIVER_CAPABILITIES", "")
    # The trainer holds the GPUs; the agent takes none from it.
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "nvidia.com/gpu" not in str(agent.get("resources", {}))
    # No startup probe: the trainer would wait for the agent to be ready, and an agent that
    # fails would hold training back (telemetry never blocks training).
    assert "startupProbe" not in agent


def test_pod_agent_args_are_valid_settings_on_the_default_port(monkeypatch):
    agent = _containers()["trainspec-agent"]
    assert agent["command"][0] == "trainspec-agent"
    args = parse_args(agent["command"][1:])
    settings = load_settings(
        overrides={"listen": args.listen, "store": args.store, "upstream": args.upstream,
                   "allow_remote": args.allow_remote},
        environ={"TRAINSPEC_AGENT_TOKEN": "from-the-secret"},
    )  # fmt: skip
    assert settings.port == DEFAULT_PORT
    assert [p["containerPort"] for p in agent["ports"]] == [DEFAULT_PORT]
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": DEFAULT_PORT}
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": DEFAULT_PORT}
    # The token file the agent reads is where the secret is mounted.
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert args.token_file.startswith(mounts["agent-token"] + "/")
    annotations = _pod()["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)


def test_pod_trainer_finds_the_agent_and_shares_its_store():
    trainer, agent = _containers()["trainer"], _containers()["trainspec-agent"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    cfg = load_config(environ={k: v for k, v in env.items() if v is not None})
    assert cfg.collector.mode == "sidecar"
    url = urlsplit(agent_endpoint(cfg.agent.endpoint, env))
    assert (url.hostname, url.port) == ("127.0.0.1", DEFAULT_PORT)
    # Operator actions reach the ranks only with agent.endpoint set (operator_actions.py).
    assert cfg.agent.endpoint == env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    args = parse_args(agent["command"][1:])
    assert cfg.store.root == args.store
    trainer_mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert args.store in trainer_mounts
    token_env = next(e for e in trainer["env"] if e["name"] == "TRAINSPEC_AGENT_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"]["name"] == "trainspec-agent-token"


def test_systemd_unit_runs_the_console_script_with_a_valid_config():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "trainspec-agent.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "trainspec-agent"
    args = parse_args(argv[1:])
    assert args.config == "/etc/trainspec/agent.toml"
    settings = load_settings(str(DEPLOY / "systemd" / "agent.toml"), environ={})
    assert settings.port == DEFAULT_PORT and settings.host == "127.0.0.1"
    assert settings.store.startswith(unit["Service"]["ReadWritePaths"])


def _toml_keys() -> tuple[dict, dict]:
    """(the keys set in agent.toml, the commented-out `# key = value` lines parsed as TOML)."""
    text = AGENT_TOML.read_text()
    live = tomllib.loads(text)["agent"]
    commented_lines = [m[1] for line in text.splitlines() if (m := COMMENTED_KEY.match(line))]
    commented = tomllib.loads("\n".join(commented_lines))
    return live, commented


def test_systemd_agent_toml_names_every_setting_with_its_default():
    live, commented = _toml_keys()
    fields = {f.name for f in dataclasses.fields(AgentSettings)}
    named = set(live) | set(commented)
    assert not fields - named, f"add {sorted(fields - named)} to {AGENT_TOML}"
    assert not named - fields, f"{sorted(named - fields)} in {AGENT_TOML} are no settings"
    assert not set(live) & set(commented), "a key is both set and commented out"
    defaults = dataclasses.asdict(AgentSettings())
    for key, value in live.items():
        if key != "store":  # the one deliberate departure: a system path
            assert value == defaults[key], f"{key} = {value!r} is not the default"
    # A commented-out key is still a valid value for its setting once uncommented.
    for key, value in commented.items():
        assert isinstance(value, type(defaults[key])), key


def test_the_agent_accepts_the_systemd_agent_toml(tmp_path):
    settings = load_settings(str(AGENT_TOML), environ={})
    live, commented = _toml_keys()
    assert {k: getattr(settings, k) for k in live} == live
    # The commented-out values are accepted too, once uncommented (the token file made real).
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    overrides = {**commented, "token_file": str(token_file)}
    settings = load_settings(str(AGENT_TOML), overrides=overrides, environ={})
    assert settings.resolved_token() == "s3cret"
