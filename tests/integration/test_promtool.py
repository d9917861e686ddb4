"""An exposition of every catalogue metric passes `promtool check metrics` and `validate`."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.payloads import prometheus_exposition
from tests.helpers.runs import synthetic_run
from trainspec.schema import load_catalogue
from trainspec.store.compliance import validate_target

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def _check(body: bytes) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60
    )


@pytest.mark.timeout(120)
def test_every_catalogue_metric_passes_promtool(tmp_path):
    body = prometheus_exposition(synthetic_run(2, 1.0, True), every_metric=True)
    text = body.decode()
    for metric in load_catalogue():
        assert f"# TYPE {metric.prometheus_name.removesuffix('_total')}" in text, metric.name
        for attr in metric.required_attributes:
            assert f'{attr.replace(".", "_")}="' in text
    result = _check(body)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), "promtool reported lint problems"
    (tmp_path / "all.prom").write_bytes(body)
    report = validate_target(str(tmp_path / "all.prom"))
    assert report.compliant, report.render_text()


@pytest.mark.timeout(120)
def test_promtool_catches_a_name_without_its_unit_suffix():
    # The check is real: a counter not ending in _total is linted.
    body = b"# HELP trainspec_x_bytes x\n# TYPE trainspec_x_bytes counter\ntrainspec_x_bytes 1\n"
    result = _check(body)
    assert b"_total" in result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_the_agents_exposition_with_odd_attributes_passes_promtool(tmp_path):
    """A point attribute `le` (promtool: "non-histogram metrics should not have le label"),
    `quantile`, the series' own `trainspec.rank`, and values that are maps, arrays, bools
    or null: the agent's /metrics stays lint-clean, and `validate` still passes on it."""
    import json
    import time

    from tests.unit.agent_fixtures import call, running_agent

    def kv(key, value):
        return {"key": key, "value": value}

    resource = [
        kv("service.name", {"stringValue": "svc"}), kv("trainspec.run.id", {"stringValue": "odd"}),
        kv("host.name", {"stringValue": "h"}), kv("trainspec.rank", {"intValue": "0"}),
        kv("trainspec.local_rank", {"intValue": "0"}), kv("trainspec.world_size", {"intValue": "1"}),
    ]  # fmt: skip
    attrs = [
        kv("le", {"stringValue": "0.5"}), kv("quantile", {"stringValue": "0.9"}),
        kv("trainspec.rank", {"stringValue": "3"}), kv("flag", {"boolValue": True}),
        kv("nested", {"kvlistValue": {"values": [kv("a", {"intValue": "1"})]}}),
        kv("list", {"arrayValue": {"values": [{"stringValue": "x"}]}}), kv("null", {}),
    ]  # fmt: skip
    point = {"asDouble": 0.5, "timeUnixNano": str(time.time_ns()), "attributes": attrs}
    metric = {"name": "trainspec.host.cpu.utilization", "unit": "1",
              "gauge": {"dataPoints": [point]}}  # fmt: skip
    body = json.dumps({"resourceMetrics": [{"resource": {"attributes": resource},
                                            "scopeMetrics": [{"metrics": [metric]}]}]})  # fmt: skip
    with running_agent(tmp_path / "store", nvml=False) as agent:
        deadline, idle = time.monotonic() + 30, b""
        while b"trainspec_host_cpu_utilization_ratio" not in idle:  # the node's first reading
            assert time.monotonic() < deadline, idle
            time.sleep(0.2)
            _, idle = call(agent.port, "GET", "/metrics")
        headers = {"Content-Type": "application/json"}
        assert call(agent.port, "POST", "/v1/metrics", body.encode(), headers)[0] == 200
        _, text = call(agent.port, "GET", "/metrics")
    for exposition in (idle, text):
        result = _check(exposition)
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
        assert not (result.stdout + result.stderr).strip(), result.stdout + result.stderr
    assert b'le="' not in text and b'quantile="' not in text and b"None" not in text
    (tmp_path / "idle.prom").write_bytes(idle)
    report = validate_target(str(tmp_path / "idle.prom"))
    assert report.passed and report.ranks == [], report.render_text()
