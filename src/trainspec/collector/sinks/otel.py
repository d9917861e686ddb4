"""OTelSink: pre-aggregated series to OpenTelemetry over OTLP, honouring OTEL_* variables.

OTLP/HTTP protobuf by default; OTEL_EXPORTER_OTLP[_METRICS]_PROTOCOL=grpc uses
opentelemetry-exporter-otlp-proto-grpc where it is installed. A protocol without an exporter
here (grpc without that package, http/json, which the Python SDK does not offer) turns the
sink off with one warning (`OTLPProtocolUnavailable`), rather than send protobuf over HTTP to
a receiver that speaks another.

The MeterProvider's periodic reader exports on its own thread every
OTEL_METRIC_EXPORT_INTERVAL ms (5 s here when unset, rather than the SDK's 60 s), to
OTEL_EXPORTER_OTLP_ENDPOINT (or ..._METRICS_ENDPOINT). Resource attributes come from
OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES merged with the job's own. An unreachable
endpoint costs the training loop nothing: failures are counted as dropped points and logged
once, not once per interval (the SDK's own retry and failure lines are held back and the
first of them quoted in that warning).

Nor does it cost the job's exit more than `CLOSE_BUDGET_S`: an export still unanswered then
(an endpoint that accepts and never replies, an address that drops SYNs) is abandoned on its
daemon thread and its points counted as dropped, so a short run against a dead endpoint
reports its losses too. Unless OTEL_EXPORTER_OTLP[_METRICS]_TIMEOUT says otherwise, one
export may take at most one export interval (the SDK's default is 10 s), so exports keep
their cadence instead of queueing behind a dead endpoint.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from trainspec.collector.aggregate import Op, Update, batch_updates, buckets_for
from trainspec.collector.records import Batch
from trainspec.collector.sink import Sink
from trainspec.schema import Catalogue, load_catalogue

log = logging.getLogger("trainspec.collector")
DEFAULT_EXPORT_INTERVAL_MS = 5000
CLOSE_BUDGET_S = 2.0  # the most of the job's exit that the final export may take
_SDK_TIMEOUT_S = 10.0  # the exporter's own default
_TIMEOUT_VARS = ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
)
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
# The Meter method that makes each catalogue instrument kind (an event is a counter).
_CREATE_INSTRUMENT = {
    "gauge": "create_gauge",
    "histogram": "create_histogram",
    "counter": "create_counter",
    "event": "create_counter",
}


class OTLPProtocolUnavailable(ValueError):
    """The OTLP protocol the environment asks for has no exporter here: the sink is off
    (sending OTLP/HTTP protobuf to a gRPC or JSON receiver fails at every export)."""


def otlp_protocol(environ: Any) -> str:
    """OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else the
    SDK's `http/protobuf`; an empty value is unset (the OTel specification)."""
    return _protocol_setting(environ)[1]


def _protocol_setting(environ: Any) -> tuple[str, str]:
    """(the variable that set the protocol, the protocol)."""
    for name in _PROTOCOL_VARS:
        value = (environ.get(name) or "").strip().lower()
        if value:
            return name, value
    return "", "http/protobuf"


def _make_exporter(setting: tuple[str, str], timeout: float | None, headers: Any) -> Any:
    """The OTLP metric exporter for the protocol of `setting` (`_protocol_setting`), or
    `OTLPProtocolUnavailable` saying why not and what would make it work."""
    name, protocol = setting
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(timeout=timeout, headers=headers)
    said = f"{name}={protocol}"
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetricExporter,
            )
        except ImportError as exc:
            raise OTLPProtocolUnavailable(
                f"{said}: OTLP protocol 'grpc' needs {_GRPC_PACKAGE}, which is not installed "
                f"(pip install {_GRPC_PACKAGE}, or set {name}=http/protobuf); OTLP export is "
                f"off ({exc})"
            ) from exc
        return GrpcMetricExporter(timeout=timeout, headers=headers)
    if protocol == "http/json":
        raise OTLPProtocolUnavailable(
            f"{said}: OTLP protocol 'http/json' has no exporter in the OpenTelemetry Python "
            f"SDK; OTLP export is off (set {name}=http/protobuf, or grpc with {_GRPC_PACKAGE})"
        )
    raise OTLPProtocolUnavailable(
        f"{said}: unknown OTLP protocol {protocol!r} (http/protobuf or grpc); OTLP export is off"
    )


class _HeldBackSdkLog(logging.Filter):
    """Holds back the OTLP exporters' own warnings and errors while they export: against an
    unreachable endpoint they log each retry ('Transient error ...') and each failed export
    ('Failed to export ...'), every interval. The sink says once why exports fail, with the
    first such message of the failing export (`reason`)."""

    def __init__(self) -> None:
        super().__init__()
        self._exporting = threading.local()
        self.reason = ""  # the first message held back during the latest export

    def begin(self) -> None:
        self._exporting.on = True
        self.reason = ""

    def end(self) -> None:
        self._exporting.on = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not getattr(self._exporting, "on", False):
            return True
        if not self.reason:
            self.reason = record.getMessage()[:400]
        return False


_SDK_LOG = _HeldBackSdkLog()


def _hold_back_sdk_logs() -> None:
    for name in _EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        if _SDK_LOG not in logger.filters:
            logger.addFilter(_SDK_LOG)


def _refused(reason: str) -> bool:
    return any(m in reason for m in ("Connection refused", "ConnectionRefused", "Errno 111"))


def _counting_exporter(inner: Any, on_drop: Any, on_export: Any, final_points: Any) -> Any:
    """Wrap a MetricExporter so failed exports are counted as drops (one warning, not many).

    `on_export()` is called as each export begins (its collection has just been taken);
    `final_points()` says how many points the reader's final collection would hold, for
    `abandon` to count when that collection never runs."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class CountingExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=inner._preferred_temporality,
                preferred_aggregation=inner._preferred_aggregation,
            )
            self.failures = 0
            self._lock = threading.Lock()
            self._in_flight = 0  # points of the export under way
            self._in_flight_periodic = False  # began before close: the final one is behind it
            self._abandoned = False
            self.closing = False  # set by the sink as it begins to close

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            points = _count_points(metrics_data)
            with self._lock:
                if self._abandoned:  # after close gave up: these points never leave
                    on_drop(points)
                    return MetricExportResult.FAILURE
                self._in_flight = points
                self._in_flight_periodic = not self.closing
            on_export()
            _SDK_LOG.begin()
            try:
                result = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception as exc:  # never let the reader thread die
                log.debug("trainspec: OTLP export raised: %s", exc)
                result = MetricExportResult.FAILURE
                _SDK_LOG.reason = _SDK_LOG.reason or f"{type(exc).__name__}: {exc}"
            finally:
                _SDK_LOG.end()
            with self._lock:
                if self._abandoned:  # already counted by `abandon`
                    return result
                self._in_flight = 0
            if result is not MetricExportResult.SUCCESS:
                self.failures += 1
                on_drop(points)
                if self.failures == 1:  # the SDK's own lines are held back (`_SDK_LOG`)
                    log.warning(
                        "trainspec: OTLP export to %s failed (%s); counting drops, warning once",
                        getattr(inner, "_endpoint", "the endpoint"),
                        _SDK_LOG.reason or "no reason given",
                    )
            return result

        def abandon(self) -> int:
            """Count the export under way (if any) as dropped and refuse later ones; returns
            the points counted. Its thread may still finish; its result is then ignored.
            When that export was a periodic one, the reader's thread never reached its final
            collection (the points since), which is lost too and counted with it."""
            with self._lock:
                self._abandoned = True
                points, self._in_flight = self._in_flight, 0
                if points and self._in_flight_periodic:
                    points += final_points()
            if points:
                on_drop(points)
            return points

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
        headers: dict[str, str] | None = None,
        protocol: str | None = None,
    ) -> None:
        """`protocol`: the OTLP protocol to use whatever the environment asks for (the
        agent's endpoint speaks http/protobuf only)."""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        env = os.environ if environ is None else environ
        self.catalogue = catalogue or load_catalogue()
        self.dropped = 0
        self._lock = threading.Lock()
        interval = export_interval_ms
        if interval is None and "OTEL_METRIC_EXPORT_INTERVAL" not in env:
            interval = DEFAULT_EXPORT_INTERVAL_MS
        if exporter is None:  # OTLPProtocolUnavailable: the caller says it, the sink is off
            setting = _protocol_setting(env) if protocol is None else ("protocol", protocol)
            exporter = _make_exporter(setting, export_timeout_s(interval, env), headers)
        _hold_back_sdk_logs()
        self.exporter = _counting_exporter(
            exporter, self._on_drop, self._on_export, self._final_points
        )
        self._delta_kinds = _delta_instrument_kinds(exporter)
        views = [
            View(
                instrument_name=m.name,
                aggregation=ExplicitBucketHistogramAggregation(list(buckets_for(m))),
            )
            for m in self.catalogue
            if m.instrument == "histogram"
        ]
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; ours win.
        otel_resource = Resource.create(dict(resource))
        # The reader's thread starts with it. A MeterProvider that refuses the environment
        # (OTEL_METRICS_EXEMPLAR_FILTER=bogus) left it ticking for the life of the job,
        # logging at every interval that it had no provider.
        reader = PeriodicExportingMetricReader(self.exporter, export_interval_millis=interval)
        try:
            # shutdown_on_exit off: `close` shuts it down; a forked child exiting must not
            # export its parent's series again from an atexit handler of its own.
            self.provider = MeterProvider(
                resource=otel_resource,
                metric_readers=[reader],
                views=views,
                shutdown_on_exit=False,
            )
        except BaseException:
            _stop_unregistered(reader)
            raise
        self._meter = self.provider.get_meter("trainspec", self.catalogue.version)
        self._instruments: dict[str, Any] = {}
        self._last_cumulative: dict[tuple[str, tuple], float] = {}
        # The series recorded so far (each a data point of a cumulative collection) and those
        # recorded since the last collection (the data points of a delta one).
        self._series: dict[tuple[str, tuple], bool] = {}  # -> exported with delta temporality
        self._touched: set[tuple[str, tuple]] = set()
        self._closed = False

    def _on_drop(self, n: int) -> None:
        with self._lock:
            self.dropped += n

    def _on_export(self) -> None:
        with self._lock:
            self._touched.clear()

    def _final_points(self) -> int:
        """The data points a collection taken now would export, under each instrument's
        temporality (measurements between the last collection and its export's start are
        counted here too: a microseconds' window)."""
        with self._lock:
            return sum(
                1 for key, delta in self._series.items() if not delta or key in self._touched
            )

    def _instrument(self, name: str) -> Any:
        inst = self._instruments.get(name)
        if inst is None:
            m = self.catalogue[name]
            make = getattr(self._meter, _CREATE_INSTRUMENT[m.instrument])
            inst = self._instruments[name] = make(m.name, unit=m.unit, description=m.description)
        return inst

    def write(self, batch: Batch) -> None:
        self.record(batch_updates(batch, self.catalogue))

    def record(self, updates: Iterable[Update]) -> None:
        """Hand `updates` to the SDK's instruments (what `write` does with a batch's)."""
        recorded: dict[tuple[str, tuple], bool] = {}
        for u in updates:
            inst = self._instrument(u.metric.name)
            attrs = dict(u.attrs)
            key = (u.metric.name, u.attrs)
            if u.op is Op.OBSERVE:
                inst.record(u.value, attrs)
            elif u.metric.instrument in ("counter", "event"):
                delta = u.value
                if u.op is Op.SET:  # a cumulative reading: add what is new since the last
                    delta = u.value - self._last_cumulative.get(key, 0.0)
                    self._last_cumulative[key] = u.value
                if delta < 0:
                    continue
                inst.add(delta, attrs)  # add(0) too: a counter that stayed at 0 is reported
            else:
                inst.set(u.value, attrs)
            recorded[key] = self._delta_kinds.get(u.metric.instrument, False)
        with self._lock:
            self._series.update(recorded)
            self._touched.update(recorded)

    def flush(self, *, timeout_s: float = 5.0) -> None:
        self.provider.force_flush(timeout_millis=int(timeout_s * 1000))

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Export what is left within min(`timeout_s`, `CLOSE_BUDGET_S`); the export still
        under way then is counted as dropped, and when it was a periodic one, so is the final
        collection it held back (the points since), which never runs before exit."""
        if self._closed:
            return
        self._closed = True
        self.exporter.closing = True
        budget = min(timeout_s, CLOSE_BUDGET_S)
        try:
            self.provider.shutdown(timeout_millis=int(budget * 1000))
        finally:
            if self.exporter.abandon():
                # Said once: at info level when the first failure was already said.
                level = logging.INFO if self.exporter.failures else logging.WARNING
                how = "refused connections" if _refused(_SDK_LOG.reason) else "did not answer"
                log.log(
                    level,
                    "trainspec: OTLP endpoint %s; the export under way at exit was abandoned "
                    "after %.1f s and is counted as dropped",
                    how,
                    budget,
                )


def _delta_instrument_kinds(exporter: Any) -> dict[str, bool]:
    """Which catalogue instrument kinds the exporter takes with delta temporality
    (OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE); cumulative is the SDK's default."""
    from opentelemetry.sdk.metrics import Counter, Histogram
    from opentelemetry.sdk.metrics._internal.instrument import _Gauge
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    preferred = getattr(exporter, "_preferred_temporality", None) or {}
    classes = {"gauge": _Gauge, "histogram": Histogram, "counter": Counter, "event": Counter}
    return {
        kind: preferred.get(cls) is AggregationTemporality.DELTA for kind, cls in classes.items()
    }


def export_timeout_s(interval_ms: float | None, environ: dict[str, str] | Any) -> float | None:
    """The exporter's timeout: None (the SDK reads OTEL_EXPORTER_OTLP[_METRICS]_TIMEOUT) when
    the environment sets one, else one export interval, at most the SDK's 10 s."""
    if any(environ.get(name) for name in _TIMEOUT_VARS):
        return None
    if interval_ms is None:  # OTEL_METRIC_EXPORT_INTERVAL is set: the SDK's parse of it
        try:
            interval_ms = float(environ.get("OTEL_METRIC_EXPORT_INTERVAL", ""))
        except ValueError:
            return _SDK_TIMEOUT_S
    if not interval_ms > 0:
        return _SDK_TIMEOUT_S
    return min(_SDK_TIMEOUT_S, interval_ms / 1000.0)


def otel_enabled(mode: str, environ: Sequence[str] | dict[str, str] | None = None) -> bool:
    """`auto` turns the sink on when an OTLP endpoint is configured in the environment."""
    env = os.environ if environ is None else environ
    if mode == "on":
        return True
    if mode == "off":
        return False
    if not hasattr(env, "get"):  # the names of the variables set
        return any(name in env for name in _ENDPOINT_VARS)
    # An empty value is unset (the OTel specification; the SDK reads it so too): it used to
    # turn the sink on, exporting to the SDK's default localhost:4318.
    return any((env.get(name) or "").strip() for name in _ENDPOINT_VARS)


def _stop_unregistered(reader: Any) -> None:
    """Stop a periodic reader no MeterProvider took, without its last collection's warning
    that it has none (the sink's own failure is what to report)."""
    sdk_log = logging.getLogger("opentelemetry.sdk.metrics._internal.export")
    level = sdk_log.level
    sdk_log.setLevel(logging.ERROR)
    try:
        reader.shutdown(timeout_millis=1_000)
    except Exception as exc:  # noqa: BLE001 - a failing shutdown of a thread that never ran
        log.debug("trainspec: OpenTelemetry reader did not stop cleanly: %s", exc)
    finally:
        sdk_log.setLevel(level)
