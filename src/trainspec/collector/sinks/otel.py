"""OTelSink: pre-aggregated series to OpenTelemetry over OTLP/HTTP, honouring OTEL_* variables.

The MeterProvider's periodic reader exports on its own thread every
OTEL_METRIC_EXPORT_INTERVAL ms (5 s here when unset, rather than the SDK's 60 s), to
OTEL_EXPORTER_OTLP_ENDPOINT (or ..._METRICS_ENDPOINT). Resource attributes come from
OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES merged with the job's own. An unreachable
endpoint costs the training loop nothing: failures are counted as dropped points and logged
once, not once per interval.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from trainspec.collector.aggregate import Op, batch_updates, buckets_for
from trainspec.collector.records import Batch
from trainspec.collector.sink import Sink
from trainspec.schema import Catalogue, load_catalogue

log = logging.getLogger("trainspec.collector")
DEFAULT_EXPORT_INTERVAL_MS = 5000
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.metric_exporter",)


def _counting_exporter(inner: Any, on_drop: Any) -> Any:
    """Wrap a MetricExporter so failed exports are counted as drops (one warning, not many)."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class CountingExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=inner._preferred_temporality,
                preferred_aggregation=inner._preferred_aggregation,
            )
            self.failures = 0

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            try:
                result = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception as exc:  # never let the reader thread die
                log.debug("trainspec: OTLP export raised: %s", exc)
                result = MetricExportResult.FAILURE
            if result is not MetricExportResult.SUCCESS:
                self.failures += 1
                on_drop(_count_points(metrics_data))
                if self.failures == 1:
                    log.warning("trainspec: OTLP export failed; counting drops, warning once")
                    for name in _EXPORTER_LOGGERS:  # the SDK warns on every interval
                        logging.getLogger(name).setLevel(logging.CRITICAL)
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return inner.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return CountingExporter()


def _count_points(metrics_data: Any) -> int:
    n = 0
    for rm in getattr(metrics_data, "resource_metrics", []):
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                n += len(m.data.data_points)
    return n


class OTelSink(Sink):
    name = "otel"

    def __init__(
        self,
        resource: dict[str, Any],
        *,
        exporter: Any = None,
        export_interval_ms: int | None = None,
        catalogue: Catalogue | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        env = os.environ if environ is None else environ
        self.catalogue = catalogue or load_catalogue()
        self.dropped = 0
        self._lock = threading.Lock()
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter()
        self.exporter = _counting_exporter(exporter, self._on_drop)
        interval = export_interval_ms
        if interval is None and "OTEL_METRIC_EXPORT_INTERVAL" not in env:
            interval = DEFAULT_EXPORT_INTERVAL_MS
        reader = PeriodicExportingMetricReader(self.exporter, export_interval_millis=interval)
        views = [
            View(
                instrument_name=m.name,
                aggregation=ExplicitBucketHistogramAggregation(list(buckets_for(m))),
            )
            for m in self.catalogue
            if m.instrument == "histogram"
        ]
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; ours win.
        self.provider = MeterProvider(
            resource=Resource.create(dict(resource)), metric_readers=[reader], views=views
        )
        self._meter = self.provider.get_meter("trainspec", self.catalogue.version)
        self._instruments: dict[str, Any] = {}
        self._last_cumulative: dict[tuple[str, tuple], float] = {}
        self._closed = False

    def _on_drop(self, n: int) -> None:
        with self._lock:
            self.dropped += n

    def _instrument(self, name: str) -> Any:
        inst = self._instruments.get(name)
        if inst is None:
            m = self.catalogue[name]
            make = {
                "gauge": self._meter.create_gauge,
                "histogram": self._meter.create_histogram,
                "counter": self._meter.create_counter,
                "event": self._meter.create_counter,
            }[m.instrument]
            inst = self._instruments[name] = make(m.name, unit=m.unit, description=m.description)
        return inst

    def write(self, batch: Batch) -> None:
        for u in batch_updates(batch, self.catalogue):
            inst = self._instrument(u.metric.name)
            attrs = dict(u.attrs)
            if u.op is Op.OBSERVE:
                inst.record(u.value, attrs)
            elif u.metric.instrument in ("counter", "event"):
                delta = u.value
                if u.op is Op.SET:  # a cumulative reading: add what is new since the last
                    key = (u.metric.name, u.attrs)
                    delta = u.value - self._last_cumulative.get(key, 0.0)
                    self._last_cumulative[key] = u.value
                if delta >= 0:  # add(0) too: a counter that stayed at 0 is still reported
                    inst.add(delta, attrs)
            else:
                inst.set(u.value, attrs)

    def flush(self, *, timeout_s: float = 5.0) -> None:
        self.provider.force_flush(timeout_millis=int(timeout_s * 1000))

    def close(self, *, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.provider.shutdown(timeout_millis=int(timeout_s * 1000))


def otel_enabled(mode: str, environ: Sequence[str] | dict[str, str] | None = None) -> bool:
    """`auto` turns the sink on when an OTLP endpoint is configured in the environment."""
    env = os.environ if environ is None else environ
    if mode == "on":
        return True
    if mode == "off":
        return False
    return "OTEL_EXPORTER_OTLP_ENDPOINT" in env or "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" in env
