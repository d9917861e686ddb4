"""OTLP settings from the environment: the protocol, an empty endpoint, and what an
endpoint that refuses connections logs."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import types

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult

from tests.unit.test_sinks import RESOURCE, RecordingExporter, make_batch
from trainspec.collector.sinks.otel import (
    OTelSink,
    OTLPProtocolUnavailable,
    _make_exporter,
    otel_enabled,
    otlp_protocol,
)

GRPC_MODULE = "opentelemetry.exporter.otlp.proto.grpc.metric_exporter"


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " ", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c"},
            True,
        ),
        ({}, False),
    ],
)
def test_an_empty_endpoint_is_unset(env, on):
    """The OTel specification reads an empty value as unset: it turned the sink on, which
    then exported to the SDK's default localhost:4318 and counted every point dropped."""
    assert otel_enabled("auto", env) is on
    assert otel_enabled("on", env) is True and otel_enabled("off", env) is False


def test_the_protocol_comes_from_the_metrics_variable_then_the_general_one():
    assert otlp_protocol({}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": ""}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json",
    }
    assert otlp_protocol(both) == "http/json"
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    assert isinstance(_make_exporter(("", "http/protobuf"), 1.0, None), OTLPMetricExporter)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "'http/json' has no exporter"),
        (
            {"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"},
            "pip install opentelemetry-exporter-otlp-proto-grpc, or set "
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL=http/protobuf",
        ),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, "unknown OTLP protocol"),
    ],
)
def test_a_protocol_without_an_exporter_turns_the_sink_off_saying_why(monkeypatch, env, said):
    """grpc and http/json both sent OTLP/HTTP protobuf, without a word."""
    monkeypatch.setitem(sys.modules, GRPC_MODULE, None)  # not installed (an ImportError)
    with pytest.raises(OTLPProtocolUnavailable, match="OTLP export is off") as raised:
        OTelSink(RESOURCE, environ=env, export_interval_ms=60_000)
    assert said in str(raised.value)


def test_grpc_uses_the_grpc_exporter_where_it_is_installed(monkeypatch):
    made: list[dict] = []

    class GrpcExporter(RecordingExporter):
        def __init__(self, **kwargs):
            super().__init__()
            made.append(kwargs)

    fake = types.ModuleType(GRPC_MODULE)
    fake.OTLPMetricExporter = GrpcExporter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, GRPC_MODULE, fake)
    sink = OTelSink(
        RESOURCE, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, export_interval_ms=500
    )
    try:
        sink.write(make_batch())
        sink.flush(timeout_s=2.0)
    finally:
        sink.close(timeout_s=2.0)
    assert made == [{"timeout": 0.5, "headers": None}]
    assert sink.dropped == 0


def _refused_port() -> int:
    with socket.socket() as s:  # bound then released: connections to it are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refusing_sink(monkeypatch, caplog, interval_ms: int) -> OTelSink:
    url = f"http://127.0.0.1:{_refused_port()}/v1/metrics"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", url)
    for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO)
    sink = OTelSink(RESOURCE, export_interval_ms=interval_ms)
    sink.write(make_batch())
    return sink


def _loud(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_endpoint_that_refuses_connections_is_logged_once(monkeypatch, caplog):
    """The SDK logged each failed export ('Failed to export ...') beside trainspec's warning,
    and each retry ('Transient error ...')."""
    sink = _refusing_sink(monkeypatch, caplog, 1000)
    time.sleep(2.5)  # one export failed, the next under way or failed
    sink.write(make_batch(t0=1002.0))
    sink.close(timeout_s=2.0)
    assert len(_loud(caplog)) == 1, _loud(caplog)
    assert "OTLP" in _loud(caplog)[0]
    assert sink.dropped > 0


class _RetryingRefused(RecordingExporter):
    """Says what the SDK's exporter says of a refused connection, then waits to retry."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.metric_exporter").warning(
            "Transient error HTTPConnectionPool(host='127.0.0.1', port=9): Max retries "
            'exceeded (Caused by NewConnectionError("Failed to establish a new connection: '
            '[Errno 111] Connection refused")) encountered while exporting metrics batch, '
            "retrying in 1.00s."
        )
        self.release.wait(5.0)
        return MetricExportResult.FAILURE


def test_an_export_retrying_a_refused_connection_at_exit_is_said_as_refused(caplog):
    """The exit message said the endpoint 'did not answer' when it refused connections, and
    came after the SDK's own 'Transient error' line."""
    caplog.set_level(logging.INFO)
    inner = _RetryingRefused()
    sink = OTelSink(RESOURCE, exporter=inner, export_interval_ms=200)
    sink.write(make_batch())
    time.sleep(0.4)  # the first export is under way, retrying
    try:
        sink.close(timeout_s=0.5)
    finally:
        inner.release.set()
    assert len(_loud(caplog)) == 1, _loud(caplog)
    assert "OTLP endpoint refused connections" in _loud(caplog)[0]
    assert sink.dropped > 0
