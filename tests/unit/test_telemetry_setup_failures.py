"""Telemetry that cannot be set up is switched off with a warning; the job goes on.

A store root that is a file (or a read-only disk) and an OTEL_* value the SDK refuses both
used to raise out of `trainspec.init`, which the zero-code path calls inside the script's
own `dist.init_process_group`: the training job died."""

from __future__ import annotations

import logging
import threading

import pytest

import trainspec
from tests.helpers.env import one_process


def _steps(ts, n: int = 3) -> None:
    for _ in range(n):
        with ts.step(samples=4):
            pass


def test_a_store_root_that_is_a_file_switches_the_store_off(tmp_path, monkeypatch, caplog):
    one_process(monkeypatch)
    root = tmp_path / "afile.txt"
    root.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        ts = trainspec.init(run_root=root)
    try:
        assert ts.collector is not None  # the rest of the collector still runs
        assert not any(s.name == "store" for s in ts.collector.sinks)
        _steps(ts)
    finally:
        ts.close()
    assert "run store off" in caplog.text and "afile.txt" in caplog.text
    assert root.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("OTEL_METRIC_EXPORT_INTERVAL", "0"), ("OTEL_METRICS_EXEMPLAR_FILTER", "bogus")],
)
def test_an_otel_value_the_sdk_refuses_switches_opentelemetry_off(
    variable, value, tmp_path, monkeypatch, caplog
):
    pytest.importorskip("opentelemetry.sdk")
    one_process(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, value)
    before = {t.ident for t in threading.enumerate()}
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        ts = trainspec.init(run_root=tmp_path)
    try:
        assert ts.collector is not None
        assert [s.name for s in ts.collector.sinks if s.name == "otel"] == []
        assert any(s.name == "store" for s in ts.collector.sinks)  # the store still writes
        _steps(ts)
    finally:
        ts.close()
    assert "OpenTelemetry off" in caplog.text
    assert (ts.run_dir / "segments" / "steps").is_dir()
    # The SDK's periodic reader starts its thread before the MeterProvider refuses the
    # value: it must not be left ticking (and warning) for the rest of the job.
    readers = [t for t in threading.enumerate() if t.name == "OtelPeriodicExportingMetricReader"]
    assert [t for t in readers if t.ident not in before] == []
