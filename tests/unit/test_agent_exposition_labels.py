"""The agent's `/metrics`: point attributes become valid, free labels with readable values, and
an idle agent's exposition (the node's own series alone) passes `trainspec validate`."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.agent_fixtures import call, running_agent
from trainspec.agent.exposition import label_value, safe_attrs
from trainspec.cli.main import main
from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, encode_tables
from trainspec.store.tables import SAMPLES

PROMTOOL = shutil.which("promtool")
CPU = "trainspec_host_cpu_utilization_ratio"


def _kv(key: str, value: dict) -> dict:
    return {"key": key, "value": value}


def _otlp(point_attrs: list[dict], extra_resource: list[dict] = ()) -> bytes:
    resource = [
        _kv("service.name", {"stringValue": "svc"}),
        _kv("trainspec.run.id", {"stringValue": "labels"}),
        _kv("host.name", {"stringValue": "h"}),
        _kv("trainspec.rank", {"intValue": "0"}),
        _kv("trainspec.local_rank", {"intValue": "0"}),
        _kv("trainspec.world_size", {"intValue": "1"}),
        *extra_resource,
    ]
    point = {"asDouble": 0.5, "timeUnixNano": str(time.time_ns()), "attributes": point_attrs}
    metric = {"name": "trainspec.host.cpu.utilization", "unit": "1",
              "gauge": {"dataPoints": [point]}}  # fmt: skip
    doc = {"resourceMetrics": [{"resource": {"attributes": resource},
                                "scopeMetrics": [{"metrics": [metric]}]}]}  # fmt: skip
    return json.dumps(doc).encode()


ODD_ATTRS = [
    _kv("le", {"stringValue": "0.5"}),  # promtool: non-histogram metrics should not have le
    _kv("quantile", {"stringValue": "q"}),
    _kv("trainspec.rank", {"stringValue": "9"}),  # the series' own label, set twice
    _kv("nested", {"kvlistValue": {"values": [_kv("a", {"intValue": "1"})]}}),
    _kv("list", {"arrayValue": {"values": [{"stringValue": "x"}, {"intValue": "2"}]}}),
    _kv("flag", {"boolValue": True}),
    _kv("null", {}),
    _kv("a.b", {"stringValue": "first"}),
    _kv("a_b", {"stringValue": "second"}),  # the same label as a.b
    _kv("9lives", {"stringValue": "x"}),  # no label name
]


def test_label_values_are_json_not_python_repr():
    assert [label_value(v) for v in ("s", 3, 0.5, True, False)] == ["s", "3", "0.5", "true",
                                                                   "false"]  # fmt: skip
    assert label_value({"a": 1, "b": [None]}) == '{"a":1,"b":[null]}'
    assert label_value(None) is None
    raw = json.dumps({"le": 1, "quantile": 2, "x": {"a": 1}, "n": None, "t": True, "z.y": 1,
                      "z_y": 2, "trainspec.rank": 4})  # fmt: skip
    assert json.loads(safe_attrs(raw, frozenset({"trainspec_rank"}))) == {
        "x": '{"a":1}', "t": "true", "z.y": "1"
    }  # fmt: skip


def test_odd_attributes_make_valid_labels(tmp_path):
    with running_agent(tmp_path, nvml=False) as agent:
        headers = {"Content-Type": "application/json"}
        body = _otlp(ODD_ATTRS, [_kv("quantile", {"stringValue": "r"})])
        assert call(agent.port, "POST", "/v1/metrics", body, headers)[0] == 200
        _, text = call(agent.port, "GET", "/metrics")
    (family,) = [f for f in text_string_to_metric_families(text.decode()) if f.name == CPU
                 and any(s.labels.get("trainspec_run_id") == "labels" for s in f.samples)]  # fmt: skip
    (sample,) = [s for s in family.samples if s.labels.get("trainspec_run_id") == "labels"]
    assert sample.labels == {
        "service_name": "svc", "trainspec_run_id": "labels", "host_name": "h",
        "trainspec_rank": "0", "trainspec_local_rank": "0", "trainspec_world_size": "1",
        "nested": '{"a":1}', "list": '["x",2]', "flag": "true", "a_b": "first",
    }  # fmt: skip
    if PROMTOOL is not None:
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                              timeout=60)  # fmt: skip
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint


@pytest.mark.timeout(60)
def test_an_idle_agents_metrics_pass_validate(tmp_path, capsys):
    """Node series only (no rank has sent anything): `validate` charged the node with 12
    rank requirements, rank `?`. The node is judged as a node, `--strict` included."""
    with running_agent(tmp_path / "store", nvml=False) as agent:
        deadline = time.monotonic() + 30
        text = b""
        while CPU.encode() not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            _, text = call(agent.port, "GET", "/metrics")
    assert CPU.encode() in text
    assert b"trainspec_rank" not in text
    target = tmp_path / "idle.prom"
    target.write_bytes(text)
    assert main(["validate", "--strict", str(target)]) == 0, capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_familys_series_with_other_attribute_keys_keep_their_labels(tmp_path):
    """Through the agent (QA repro_label_shift.py): GPU 1, whose reading has another key than
    GPU 0's, came out as hw_id="instant"; GPU 2, with one key fewer, was not exported."""
    attrs = [{"gpu.index": 0, "hw.id": "GPU-a"}, {"gpu.index": 1, "trainspec.power.kind": "instant"},
             {"gpu.index": 2}]  # fmt: skip
    rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.gpu.power", "value": 250.0 + i,
             "attrs": json.dumps(a)} for i, a in enumerate(attrs)]  # fmt: skip
    body = encode_tables({"samples": pa.Table.from_pylist(rows, schema=SAMPLES)})
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": "shift",
               "X-Trainspec-Rank": "0"}  # fmt: skip
    with running_agent(tmp_path, nvml=False) as agent:
        assert call(agent.port, "POST", "/v1/trainspec/batches", body, headers)[0] == 200
        _, text = call(agent.port, "GET", "/metrics")
    (family,) = [f for f in text_string_to_metric_families(text.decode())
                 if f.name == "trainspec_gpu_power_watts"]  # fmt: skip
    point_labels = {"gpu_index", "hw_id", "trainspec_power_kind"}
    got = {
        s.value: {k: v for k, v in s.labels.items() if k in point_labels}
        for s in family.samples
        if s.labels.get("trainspec_run_id") == "shift"
    }
    assert got == {
        250.0: {"gpu_index": "0", "hw_id": "GPU-a"},
        251.0: {"gpu_index": "1", "trainspec_power_kind": "instant"},
        252.0: {"gpu_index": "2"},
    }
    if PROMTOOL is not None:
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                              timeout=60)  # fmt: skip
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint
