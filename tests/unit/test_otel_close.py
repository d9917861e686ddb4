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
