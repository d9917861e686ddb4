"""OTLP exports from ranks in sidecar mode carry the agent's token, to the agent only."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from tests.unit.agent_fixtures import call, running_agent
from trainspec.collector.records import Batch
from trainspec.collector.sinks.otlp_auth import agent_export_headers, otlp_metrics_endpoint
from trainspec.config import load_config
from trainspec.runtime.identity import RankIdentity
from trainspec.runtime.wiring import build_sinks
from trainspec.store.tables import SAMPLES

TOKEN = "s3cret-token"
AGENT = "http://127.0.0.1:4318"


def test_the_metrics_endpoint_resolves_as_the_sdk_does():
    assert otlp_metrics_endpoint({}) == "http://localhost:4318/v1/metrics"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1/"}
    assert otlp_metrics_endpoint(env) == "http://a:1/v1/metrics"
    env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = "http://b:2/x"
    assert otlp_metrics_endpoint(env) == "http://b:2/x"


@pytest.mark.parametrize(
    ("env", "token", "want"),
    [
        # The default endpoint (localhost:4318) is the agent's loopback address.
        ({}, TOKEN, {"authorization": f"Bearer {TOKEN}"}),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, TOKEN,
         {"authorization": f"Bearer {TOKEN}"}),
        # The user's own headers are kept beside it.
        ({"OTEL_EXPORTER_OTLP_HEADERS": "x-team=ml"}, TOKEN,
         {"x-team": "ml", "authorization": f"Bearer {TOKEN}"}),
        # No token; a user's own authorization; another host; another port: nothing added.
        ({}, "", None),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Basic%20eA=="}, TOKEN, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.monitoring:4318"}, TOKEN, None),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:9999/v1/metrics"}, TOKEN,
         None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:notaport"}, TOKEN, None),
    ],
)  # fmt: skip
def test_the_token_goes_to_the_agent_and_nowhere_else(env, token, want):
    assert agent_export_headers(env, AGENT, token) == want


def test_a_sidecar_ranks_otlp_exports_are_accepted_by_an_agent_with_a_token(tmp_path, monkeypatch):
    """As deploy/kubernetes/trainer-with-agent.yaml sets a rank up: every OTLP export was
    refused with 401 (found 2026-11-25)."""
    with running_agent(tmp_path / "store", token=TOKEN) as agent:
        endpoint = f"http://127.0.0.1:{agent.port}"
        env = {
            "TRAINSPEC_COLLECTOR_MODE": "sidecar",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "TRAINSPEC_AGENT_TOKEN": TOKEN,
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cfg = load_config(environ=env)
        ident = RankIdentity(0, 0, 1, "h")
        resource = {"service.name": "t", "trainspec.run.id": "auth-run", "trainspec.rank": 0}
        sinks, store = build_sinks(cfg, ident, tmp_path / "run", resource)
        otel = next(s for s in sinks if s.name == "otel")
        rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.host.memory.used",
                 "value": 1e9, "attrs": "{}"}]  # fmt: skip
        try:
            otel.write(Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], []))
            otel.flush()
            assert otel.dropped == 0
            assert agent.counters.snapshot()["rejected"].get("unauthorized", 0) == 0
        finally:
            for sink in sinks:
                sink.close()
        _, text = call(agent.port, "GET", "/metrics")
        assert b"trainspec_host_memory_used_bytes{" in text


def test_a_sidecar_ranks_exports_to_the_agent_use_http_whatever_protocol_is_asked(
    tmp_path, monkeypatch, caplog
):
    """The agent serves OTLP over HTTP only: with OTEL_EXPORTER_OTLP_PROTOCOL=grpc a sidecar
    rank's exports to it all failed (or the sink went off). They go as http/protobuf, said
    once (review, 2026-11-28)."""
    with running_agent(tmp_path / "store", token=TOKEN) as agent:
        endpoint = f"http://127.0.0.1:{agent.port}"
        env = {
            "TRAINSPEC_COLLECTOR_MODE": "sidecar",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "TRAINSPEC_AGENT_TOKEN": TOKEN,
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cfg = load_config(environ=env)
        resource = {"service.name": "t", "trainspec.run.id": "grpc-run", "trainspec.rank": 0}
        with caplog.at_level("WARNING", logger="trainspec"):
            sinks, _ = build_sinks(cfg, RankIdentity(0, 0, 1, "h"), tmp_path / "run", resource)
        try:
            otel = next(s for s in sinks if s.name == "otel")
            rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.host.memory.used",
                     "value": 1e9, "attrs": "{}"}]  # fmt: skip
            otel.write(Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], []))
            otel.flush()
            assert otel.dropped == 0
        finally:
            for sink in sinks:
                sink.close()
        said = [r.getMessage() for r in caplog.records if "speaks OTLP over HTTP" in r.getMessage()]
        assert len(said) == 1 and "'grpc'" in said[0]
