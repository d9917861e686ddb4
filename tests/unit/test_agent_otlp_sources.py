"""OTLP on the agent's /metrics: one source per run and rank, wherever the sender put them,
and never the node's own.

Found 2026-11-27: a sender with `trainspec.rank` as a point attribute (not a resource one)
had ranks 0 and 1 exported with identical labels (Prometheus keeps one); and a sender with
neither run nor rank, arriving before the node sampler's first flush, took the node's source:
the host series then carried its resource (service_name="someone-else", no host_name)."""

from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.agent_fixtures import call, running_agent


def _kv(key: str, value: dict) -> dict:
    return {"key": key, "value": value}


def _doc(resource: list[dict], metric: str, points: list[tuple[float, list[dict]]]) -> bytes:
    now = str(time.time_ns())
    data = [{"asDouble": v, "timeUnixNano": now, "attributes": a} for v, a in points]
    doc = {"resourceMetrics": [{"resource": {"attributes": resource}, "scopeMetrics": [
        {"metrics": [{"name": metric, "unit": "1", "gauge": {"dataPoints": data}}]}]}]}  # fmt: skip
    return json.dumps(doc).encode()


def _post(port: int, body: bytes) -> None:
    status, raw = call(port, "POST", "/v1/metrics", body, {"Content-Type": "application/json"})
    assert status == 200, raw


def _samples(port: int, prefix: str) -> list[tuple[dict[str, str], float]]:
    _, text = call(port, "GET", "/metrics")
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
        if s.name.startswith(prefix)
    ]


def test_a_per_point_rank_and_run_are_labels(tmp_path):
    resource = [_kv("service.name", {"stringValue": "otelsdk"})]
    points = [
        (0.1, [_kv("trainspec.rank", {"intValue": "0"}), _kv("trainspec.run.id",
                                                           {"stringValue": "dup"})]),
        (0.2, [_kv("trainspec.rank", {"intValue": "1"}), _kv("trainspec.run.id",
                                                           {"stringValue": "dup"})]),
    ]  # fmt: skip
    with running_agent(tmp_path, nvml=False) as agent:
        _post(agent.port, _doc(resource, "trainspec.memory.pressure", points))
        got = _samples(agent.port, "trainspec_memory_pressure")
    labels = [tuple(sorted(lab.items())) for lab, _ in got]
    assert len(set(labels)) == len(labels) == 2, got  # no two series alike
    by_rank = {lab["trainspec_rank"]: (lab["trainspec_run_id"], v) for lab, v in got}
    assert by_rank == {"0": ("dup", 0.1), "1": ("dup", 0.2)}


def test_an_anonymous_sender_does_not_take_the_nodes_source(tmp_path):
    resource = [_kv("service.name", {"stringValue": "someone-else"})]
    with running_agent(tmp_path, nvml=False, node_interval_s=0.05) as agent:
        # Before the node sampler's first flush (0.5 s after start).
        _post(agent.port, _doc(resource, "trainspec.host.cpu.utilization", [(0.123, [])]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = _samples(agent.port, "trainspec_host_cpu_utilization")
            if any(lab.get("service_name") == "trainspec-agent" for lab, _ in got):
                break
            time.sleep(0.1)
    node = [lab for lab, _ in got if lab.get("service_name") == "trainspec-agent"]
    other = [(lab, v) for lab, v in got if lab.get("service_name") == "someone-else"]
    assert node and all(lab.get("host_name") for lab in node), got
    assert other == [({"service_name": "someone-else"}, 0.123)], got
