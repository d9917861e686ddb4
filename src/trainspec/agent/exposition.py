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
import re
import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trainspec.collector.aggregate import batch_updates
from trainspec.collector.records import Batch
from trainspec.collector.sinks.prometheus import PrometheusState, label_name
from trainspec.schema import Catalogue

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


class SeriesBook:
    """The aggregated series of every source the agent has heard from."""

    def __init__(self, catalogue: Catalogue) -> None:
        self.catalogue = catalogue
        self._states: dict[SourceKey, PrometheusState] = {}
        self._histogram_names = [m.name for m in catalogue if m.instrument == "histogram"]
        self._resource_labels = frozenset(label_name(a) for a in catalogue.resource_attributes)
        self._lock = threading.Lock()

    def state(self, key: SourceKey, resource: dict[str, Any]) -> PrometheusState:
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
                state = self._states[key] = PrometheusState(self.catalogue, clean)
            return state

    def apply_batch(self, key: SourceKey, resource: dict[str, Any], batch: Batch) -> None:
        state = self.state(key, resource)
        # The labels every rank's series carry (the exposition sets them from the resource)
        # are no point attribute's, whatever a sender put in its attributes.
        taken = self._resource_labels | {name for name, _ in state.resource}
        reduced = Batch(self._reduce(batch.samples, taken), batch.steps, batch.events)
        state.apply(batch_updates(reduced, self.catalogue))

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
    return [requests, points, rejected, forwarded, dropped, written, pending, info, gpu_info]


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
