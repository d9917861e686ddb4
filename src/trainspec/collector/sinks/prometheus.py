"""PrometheusSink: a /metrics endpoint per rank, lint-clean under `promtool check metrics`.

Several ranks on one node each serve their own port (base port + local rank), which a
Prometheus scrape config lists as targets; this avoids prometheus_client's multiprocess
mode and its shared-directory files (documented in docs/collector.md). The exposition is
built from a private registry: nothing is registered globally at import.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from trainspec.collector.aggregate import Op, Update, batch_updates, buckets_for
from trainspec.collector.records import Batch
from trainspec.collector.sink import Sink
from trainspec.schema import Catalogue, Metric, load_catalogue


def label_name(attribute: str) -> str:
    """OTel attribute -> Prometheus label (dots and dashes become underscores)."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in attribute)


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (metric name, its label pairs)


def series_key(u: Update) -> SeriesKey:
    """The series an update belongs to. An empty value is no label to Prometheus: kept,
    {a="x",b=""} would be exported beside {a="x"}, the same series twice."""
    return u.metric.name, tuple((label_name(k), v) for k, v in u.attrs if v != "")


class _Series:
    __slots__ = ("value", "bucket_counts", "total", "count")

    def __init__(self, n_buckets: int = 0) -> None:
        self.value = 0.0
        self.bucket_counts = [0] * n_buckets
        self.total = 0.0
        self.count = 0


class PrometheusState:
    """Aggregated series, updated from batches and read by the exposition."""

    def __init__(self, catalogue: Catalogue, resource: dict[str, str]) -> None:
        self.catalogue = catalogue
        self.resource = tuple(sorted((label_name(k), str(v)) for k, v in resource.items()))
        self._lock = threading.Lock()
        self._series: dict[SeriesKey, _Series] = {}

    def apply(self, updates: Iterator[Update]) -> None:
        with self._lock:
            for u in updates:
                key = series_key(u)
                series = self._series.get(key)
                if series is None:
                    n = len(buckets_for(u.metric)) if u.op is Op.OBSERVE else 0
                    series = self._series[key] = _Series(n)
                if u.op is Op.SET:
                    series.value = u.value
                elif u.op is Op.ADD:
                    series.value += u.value
                else:
                    for i, bound in enumerate(buckets_for(u.metric)):
                        if u.value <= bound:
                            series.bucket_counts[i] += 1
                    series.total += u.value
                    series.count += 1

    def forget(self, keys: Iterable[SeriesKey]) -> None:
        """Drop these series from the exposition (a key not held is ignored)."""
        with self._lock:
            for key in keys:
                self._series.pop(key, None)

    def series_keys(self) -> set[SeriesKey]:
        with self._lock:
            return set(self._series)

    def families(self) -> list[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with self._lock:
            items = [(k, _copy(s)) for k, s in self._series.items()]
        by_metric: dict[str, list] = {}
        for (name, labels), series in items:
            by_metric.setdefault(name, []).append((labels, series))
        out = []
        res_names = [k for k, _ in self.resource]
        res_values = [v for _, v in self.resource]
        for name, entries in sorted(by_metric.items()):
            metric = self.catalogue[name]
            # A family's series may carry different label names (a GPU whose reading has
            # hw.id beside one without): Prometheus forbids only the same labels twice. But a
            # prometheus_client family lays every series' values out under one list of names,
            # so each set of names gets its own family, and their samples are joined.
            parts: dict[tuple[str, ...], Any] = {}
            for labels, series in entries:
                names = tuple(res_names + [k for k, _ in labels])
                part = parts.get(names)
                if part is None:
                    part = parts[names] = _family(
                        metric, list(names), CounterMetricFamily, GaugeMetricFamily,
                        HistogramMetricFamily,
                    )  # fmt: skip
                values = res_values + [v for _, v in labels]
                if metric.instrument == "histogram":
                    cumulative = list(
                        zip([_le(b) for b in buckets_for(metric)], series.bucket_counts)
                    )
                    cumulative.append(("+Inf", series.count))
                    part.add_metric(values, cumulative, series.total)
                else:
                    part.add_metric(values, series.value)
            family, *others = parts.values()
            for other in others:
                family.samples.extend(other.samples)
            out.append(family)
        return out


def _copy(s: _Series) -> _Series:
    c = _Series()
    c.value, c.bucket_counts, c.total, c.count = s.value, list(s.bucket_counts), s.total, s.count
    return c


def _le(bound: float) -> str:
    return repr(float(bound))


def _family(metric: Metric, labels: list[str], counter: Any, gauge: Any, histogram: Any) -> Any:
    doc = metric.description or metric.name
    name = metric.prometheus_name
    if metric.instrument in ("counter", "event"):
        # prometheus_client appends _total itself
        return counter(name.removesuffix("_total"), doc, labels=labels)
    if metric.instrument == "histogram":
        return histogram(name, doc, labels=labels)
    return gauge(name, doc, labels=labels)


class _RegistryCollector:
    def __init__(self, state: PrometheusState) -> None:
        self.state = state

    def collect(self):  # prometheus_client's Collector protocol
        yield from self.state.families()


class PrometheusSink(Sink):
    """Serves the aggregated series on `http://addr:port/metrics` (port 0 = no server)."""

    name = "prometheus"

    def __init__(
        self,
        resource: dict[str, str],
        *,
        port: int = 0,
        addr: str = "127.0.0.1",
        catalogue: Catalogue | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry

        self.catalogue = catalogue or load_catalogue()
        self.state = PrometheusState(self.catalogue, resource)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RegistryCollector(self.state))
        self._server: Any = None
        self.port = port
        if port:
            from prometheus_client import start_http_server

            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
            self.port = self._server.server_port

    def write(self, batch: Batch) -> None:
        self.state.apply(batch_updates(batch, self.catalogue))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self, *, timeout_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
