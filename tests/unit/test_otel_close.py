"""An OTLP endpoint that accepts and never answers costs the job's exit at most the close
budget, and what it never received is counted as dropped."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.unit.test_sinks import RESOURCE, make_batch
from trainspec.collector.sinks.otel import CLOSE_BUDGET_S, OTelSink, export_timeout_s


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A TCP port that accepts connections and never reads or replies."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_close_against_a_silent_endpoint_takes_the_budget_and_counts_the_drop(
    blackhole, monkeypatch
):
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{blackhole}/v1/metrics"
    )
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", raising=False)
    # One export every 60 s: the only export is the final one, at close, with a 10 s timeout.
    sink = OTelSink(RESOURCE, export_interval_ms=60_000, environ={})
    sink.write(make_batch())
    t0 = time.monotonic()
    sink.close(timeout_s=10.0)
    elapsed = time.monotonic() - t0
    assert elapsed < CLOSE_BUDGET_S + 1.5, f"close took {elapsed:.1f} s"
    assert sink.dropped > 0  # the final export never arrived: counted, not lost silently


def test_the_export_timeout_is_one_interval_unless_the_environment_sets_one():
    assert export_timeout_s(5000, {}) == 5.0
    assert export_timeout_s(60_000, {}) == 10.0  # never above the SDK's own default
    assert export_timeout_s(None, {"OTEL_METRIC_EXPORT_INTERVAL": "2000"}) == 2.0
    assert export_timeout_s(None, {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}) == 10.0
    assert export_timeout_s(5000, {"OTEL_EXPORTER_OTLP_TIMEOUT": "30"}) is None
    assert export_timeout_s(5000, {"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "1"}) is None


def _stuck_sink(port: int, interval_ms: int) -> OTelSink:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{port}/v1/metrics", timeout=30)
    return OTelSink(RESOURCE, exporter=exporter, export_interval_ms=interval_ms, environ={})


def test_a_periodic_export_stuck_at_close_counts_the_final_collection_it_held_back(blackhole):
    # The same points, once at close only: what one collection of them exports.
    only_final = _stuck_sink(blackhole, 60_000)
    only_final.write(make_batch())
    only_final.close(timeout_s=1.0)
    one_collection = only_final.dropped
    assert one_collection > 0

    sink = _stuck_sink(blackhole, 200)
    sink.write(make_batch())
    deadline = time.monotonic() + 5.0
    while not sink.exporter._in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sink.exporter._in_flight == one_collection  # the periodic export, stuck
    sink.write(make_batch())  # recorded after it: only the final collection would carry it
    sink.close(timeout_s=1.0)
    # The stuck export and the final collection the reader's thread never reached.
    assert sink.dropped == 2 * one_collection


def test_under_delta_temporality_the_final_collection_holds_only_what_is_new(
    blackhole, monkeypatch
):
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    cumulative = _stuck_sink(blackhole, 60_000)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{blackhole}/v1/metrics")
    delta = OTelSink(RESOURCE, exporter=exporter, export_interval_ms=60_000, environ={})
    for sink in (cumulative, delta):
        sink.write(make_batch())
        sink._on_export()  # a collection was taken: nothing recorded since
    everything = cumulative._final_points()
    assert everything > 0
    assert 0 < delta._final_points() < everything  # gauges stay cumulative; the rest is new
    delta.write(make_batch())
    assert delta._final_points() == everything
    for sink in (cumulative, delta):
        sink.close(timeout_s=0.5)
