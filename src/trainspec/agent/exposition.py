"""The agent's `/metrics`: every rank's and the node's aggregated series, and its own health.

Each source (one rank of one run, or the node) keeps its own `PrometheusState` (the
collector's aggregation, so the agent and an embedded rank expose identical series); here
their families are merged by name, since an exposition may declare each family once
(promtool rejects a repeated `# TYPE`). The agent's own counters (`trainspec_agent_*`) and
the node inventory as an info-style gauge (`trainspec_agent_node_info`, value 1) follow.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trainspec.collector.aggregate import Op, Update, batch_updates
from trainspec.collector.records import Batch
from trainspec.collector.sinks.prometheus import (
    PrometheusState,
    SeriesKey,
    label_name,
    series_key,
)
from trainspec.schema import Catalogue

log = logging.getLogger("trainspec.agent")
SAFE_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,127}$")
# Label names the exposition gives a meaning of its own: a histogram's bucket bound and a
# summary's quantile (promtool: "non-histogram metrics should not have le label").
RESERVED_LABELS = frozenset({"le", "quantile"})


def safe_key(key: object) -> bool:
    """An attribute key that becomes a valid, non-reserved Prometheus label name."""
    return isinstance(key, str) and bool(SAFE_KEY.match(key)) and key not in RESERVED_LABELS


def label_value(value: object) -> str | None:
    """An attribute value as a label value: strings as they are, numbers as numbers, bools
    as JSON's `true`/`false`, arrays and maps as compact JSON; None (JSON null) is no value,
    and the label is dropped. str() had written Python's `{'a': 1}`, `None` and `True`."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@functools.lru_cache(maxsize=65536)
def safe_attrs(raw: str, taken: frozenset[str] = frozenset()) -> str:
    """Point attributes as a sender gave them, minus what would break the exposition for
    every source: an empty, invalid or digit-led label name, a reserved one (`le`,
    `quantile`), one the source's resource labels already use (`taken`: a second
    `trainspec_rank` on one series), and a second key for one label (`a.b` beside `a_b`).
    Values become label text (`label_value`); unreadable JSON becomes {}."""
    try:
        d = json.loads(raw)
    except ValueError:
        return "{}"
    if not isinstance(d, dict):
        return "{}"
    out: dict[str, str] = {}
    labels: set[str] = set(taken)
    for k in sorted(d):
        value = label_value(d[k])
        if not safe_key(k) or value is None or label_name(k) in labels:
            continue
        labels.add(label_name(k))
        out[k] = value
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


SourceKey = tuple[str, int]  # (run id, rank); the node is ("", -1)
NODE: SourceKey = ("", -1)


class SeriesBudget:
    """The series every source together may hold (`max_series`): past it a new series'
    updates are dropped, counted in `dropped_points`, and said once. One batch of 200,000
    distinct attribute sets made every later scrape 25 MiB and 6-7 s (found 2026-11-27)."""

    def __init__(self, max_series: int) -> None:
        self.max_series = max_series
        self.series = 0
        self.dropped_points = 0
        self.expired = 0
        self._lock = threading.Lock()
        self._warned = False

    def admit(self) -> bool:
        with self._lock:
            if self.series < self.max_series:
                self.series += 1
                return True
            self.dropped_points += 1
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("trainspec-agent: /metrics holds %d series (metrics_max_series); "
                        "updates of new series are dropped, counted in "
                        "trainspec_agent_series_dropped_points_total", self.max_series)  # fmt: skip
        return False

    def release(self, n: int) -> None:
        with self._lock:
            self.series -= n
            self.expired += n


class SourceState(PrometheusState):
    """A source's series, with when each was last updated: the book's cap and expiry."""

    def __init__(
        self, catalogue: Catalogue, resource: dict[str, str], budget: SeriesBudget
    ) -> None:
        super().__init__(catalogue, resource)
        self.budget = budget
        self.updated = time.monotonic()
        self._touched: dict[SeriesKey, tuple[float, bool]] = {}  # -> (monotonic, a gauge)
        self._book_lock = threading.Lock()  # taken before PrometheusState's own
        self.retired = False  # taken off the book (`SeriesBook.expire`): applies nothing

    def apply(self, updates: Iterator[Update]) -> None:
        self.take(updates)

    def take(self, updates: Iterator[Update]) -> bool:
        """Apply `updates`; False, with nothing applied, once the book has retired this state
        (its series would count against the cap and never be shown or expired)."""
        now = time.monotonic()
        kept = []
        with self._book_lock:
            if self.retired:
                return False
            for u in updates:
                key = series_key(u)
                if key not in self._touched and not self.budget.admit():
                    continue
                self._touched[key] = (now, u.op is Op.SET)
                kept.append(u)
            self.updated = now
            super().apply(iter(kept))
        return True

    def expire(self, now: float, ttl_s: float) -> int:
        """Forget series not updated for `ttl_s`: a gauge (a value, not a running count)
        alone; counters and histograms only with the whole source idle, as a counter that
        came back would restart from 0. Returns how many series remain."""
        with self._book_lock:
            idle = now - self.updated > ttl_s
            stale = [
                key
                for key, (seen, gauge) in self._touched.items()
                if now - seen > ttl_s and (gauge or idle)
            ]
            for key in stale:
                del self._touched[key]
            if stale:
                self.forget(stale)
                self.budget.release(len(stale))
            return len(self._touched)


class SeriesBook:
    """The aggregated series of every source the agent has heard from, at most
    `max_series` of them; a series not updated for `ttl_s` is forgotten (`SourceState`),
    and so is a source left with none."""

    def __init__(
        self, catalogue: Catalogue, *, max_series: int = 20_000, ttl_s: float = 300.0
    ) -> None:
        self.catalogue = catalogue
        self.budget = SeriesBudget(max_series)
        self.ttl_s = ttl_s
        self._states: dict[SourceKey, SourceState] = {}
        self._histogram_names = [m.name for m in catalogue if m.instrument == "histogram"]
        self._resource_labels = frozenset(label_name(a) for a in catalogue.resource_attributes)
        self._lock = threading.Lock()

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            states = list(self._states.items())
        for key, state in states:
            if state.expire(now, self.ttl_s) == 0 and now - state.updated > self.ttl_s:
                with self._lock, state._book_lock:  # an apply_batch holding it sees `retired`
                    if self._states.get(key) is state and now - state.updated > self.ttl_s:
                        del self._states[key]
                        state.retired = True

    def state(self, key: SourceKey, resource: dict[str, Any]) -> SourceState:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                clean: dict[str, str] = {}
                used: set[str] = set()
                for k, v in sorted(resource.items()):
                    value = label_value(v) if isinstance(v, (str, int, float)) else None
                    if safe_key(k) and value is not None and label_name(k) not in used:
                        used.add(label_name(k))
                        clean[k] = value
                state = self._states[key] = SourceState(self.catalogue, clean, self.budget)
            return state

    def apply_batch(self, key: SourceKey, resource: dict[str, Any], batch: Batch) -> None:
        # The source's state may be retired by `expire` between being looked up and applied
        # to: then a fresh one is made (its series counted against the cap, and lost).
        for _ in range(3):
            state = self.state(key, resource)
            # The labels every rank's series carry (the exposition sets them from the
            # resource) are no point attribute's, whatever a sender put in its attributes.
            taken = self._resource_labels | {name for name, _ in state.resource}
            reduced = Batch(self._reduce(batch.samples, taken), batch.steps, batch.events)
            if state.take(batch_updates(reduced, self.catalogue)):
                return

    def _reduce(self, samples: pa.Table, taken: frozenset[str] = frozenset()) -> pa.Table:
        """Only the last reading of each gauge series matters to a scrape; histograms keep
        every observation. Done in Arrow, so 60 metrics x 20 Hz x N ranks cost a group-by,
        not a Python loop over every point."""
        if samples.num_rows == 0:
            return samples
        hist = pa.array(self._histogram_names, pa.string())
        is_hist = pc.is_in(samples["metric"], value_set=hist)
        indexed = samples.append_column("_i", pa.array(range(samples.num_rows), pa.int64()))
        gauges = indexed.filter(pc.invert(is_hist))
        last = gauges.group_by(["metric", "attrs"], use_threads=False).aggregate([("_i", "max")])
        rows = pa.concat_arrays(
            [last["_i_max"].combine_chunks(), indexed.filter(is_hist)["_i"].combine_chunks()]
        )
        rows = pc.take(rows, pc.sort_indices(rows))  # time order, as the rank produced them
        kept = samples.take(rows)
        attrs = pa.array([safe_attrs(a, taken) for a in kept["attrs"].to_pylist()], pa.string())
        return kept.set_column(kept.schema.get_field_index("attrs"), "attrs", attrs)

    def sources(self) -> list[SourceKey]:
        with self._lock:
            return list(self._states)

    def families(self) -> list[Any]:
        self.expire()
        with self._lock:
            states = list(self._states.values())
        merged: dict[str, Any] = {}
        for state in states:
            for family in state.families():
                first = merged.get(family.name)
                if first is None:
                    merged[family.name] = family
                else:
                    first.samples.extend(family.samples)
        return [merged[name] for name in sorted(merged)]


def agent_families(status: Callable[[], dict[str, Any]]) -> list[Any]:
    """The agent's own counters and gauges from its status document."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    s = status()
    ingest = s["ingest"]
    requests = CounterMetricFamily(
        "trainspec_agent_requests", "Ingest requests accepted, by path", labels=["path"]
    )
    for kind, n in sorted(ingest["accepted_requests"].items()):
        requests.add_metric([kind], n)
    points = CounterMetricFamily(
        "trainspec_agent_points", "Points accepted from ranks, by path", labels=["path"]
    )
    for kind, n in sorted(ingest["accepted_points"].items()):
        points.add_metric([kind], n)
    rejected = CounterMetricFamily(
        "trainspec_agent_rejected_requests",
        "Requests refused (bad body, type, size, auth, overload), by reason",
        labels=["reason"],
    )
    for reason, n in sorted(ingest["rejected"].items()):
        rejected.add_metric([reason], n)
    fwd = s["forward"]
    forwarded = CounterMetricFamily(
        "trainspec_agent_forwarded_requests", "OTLP requests delivered upstream"
    )
    forwarded.add_metric([], fwd["sent"])
    dropped = CounterMetricFamily(
        "trainspec_agent_forward_dropped_requests",
        "OTLP requests dropped: upstream buffer full or refused",
    )
    dropped.add_metric([], fwd["dropped"])
    written = CounterMetricFamily("trainspec_agent_store_rows", "Rows written to the run store")
    written.add_metric([], s["store"]["rows_written"])
    pending = GaugeMetricFamily("trainspec_agent_store_pending_rows", "Rows waiting for a commit")
    pending.add_metric([], s["store"]["pending_rows"])
    book = s["metrics"]
    series = GaugeMetricFamily("trainspec_agent_series", "Series /metrics holds for the sources")
    series.add_metric([], book["series"])
    capped = CounterMetricFamily(
        "trainspec_agent_series_dropped_points",
        "Updates of new series dropped: /metrics held metrics_max_series series",
    )
    capped.add_metric([], book["dropped_points"])
    expired = CounterMetricFamily(
        "trainspec_agent_series_expired", "Series forgotten after metrics_series_ttl_s unchanged"
    )
    expired.add_metric([], book["expired"])
    skipped = CounterMetricFamily(
        "trainspec_agent_series_feed_skipped_batches",
        "Batches stored but left off /metrics: the /metrics feed's queue was full",
    )
    skipped.add_metric([], book["feed_skipped_batches"])
    inv = s["inventory"]
    info = GaugeMetricFamily(
        "trainspec_agent_node_info",
        "Node inventory (value 1): GPU count and models, NVML availability",
        labels=["host_name", "gpu_count", "gpu_models", "nvml"],
    )
    models = ",".join(sorted({g["name"] for g in inv["gpus"]}))
    info.add_metric([inv["host"], str(len(inv["gpus"])), models, inv["nvml"]], 1.0)
    gpu_info = GaugeMetricFamily(
        "trainspec_agent_gpu_info",
        "One series per GPU of the node (value 1)",
        labels=["gpu_index", "hw_id", "model"],
    )
    for g in inv["gpus"]:
        gpu_info.add_metric([str(g["index"]), g["uuid"], g["name"]], 1.0)
    return [requests, points, rejected, forwarded, dropped, written, pending, series, capped,
            expired, skipped, info, gpu_info]  # fmt: skip


class Exposition:
    """A prometheus_client collector over the series book and the agent's own figures."""

    def __init__(self, book: SeriesBook, status: Callable[[], dict[str, Any]]) -> None:
        from prometheus_client import CollectorRegistry

        self.book = book
        self.status = status
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self):  # prometheus_client's Collector protocol
        yield from self.book.families()
        yield from agent_families(self.status)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


__all__ = ["NODE", "Exposition", "SeriesBook", "label_name"]
