"""Turn a batch into instrument updates for the aggregating exporters (OTel, Prometheus).

The store keeps every raw reading; exporters get what their stacks expect: gauges keep the
last value of the window, counters their cumulative value, histograms every observation in
explicit second-scale buckets (the OTel default buckets suit milliseconds, not seconds).
One table of rules serves both exporters, so they cannot disagree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from enum import Enum

from trainspec.collector.records import Batch, StepRecord
from trainspec.schema import Catalogue, Metric

SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(5, 21))

# checkpoint event evidence key -> catalogue metric
CHECKPOINT_EVIDENCE = {
    "duration_s": "trainspec.checkpoint.duration",
    "stall_s": "trainspec.checkpoint.stall",
    "bytes": "trainspec.checkpoint.size",
}
EVENT_COUNTERS = {
    "fault": "trainspec.faults",
    "anomaly": "trainspec.anomalies",
    "action": "trainspec.actions",
}


class Op(Enum):
    SET = "set"  # gauge: last value; cumulative counter reading: the running total
    ADD = "add"  # counter increment
    OBSERVE = "observe"  # histogram observation


@dataclass(frozen=True)
class Update:
    metric: Metric
    attrs: tuple[tuple[str, str], ...]
    op: Op
    value: float


def buckets_for(metric: Metric) -> tuple[float, ...]:
    return BYTES_BUCKETS if metric.unit == "By" else SECONDS_BUCKETS


def _attrs(raw: str | dict) -> tuple[tuple[str, str], ...]:
    if isinstance(raw, str):
        return _attrs_of_json(raw)
    return tuple(sorted((k, str(v)) for k, v in raw.items()))


@functools.lru_cache(maxsize=65536)
def _attrs_of_json(raw: str) -> tuple[tuple[str, str], ...]:
    # A rank's series repeat their attribute text every tick: parse each text once.
    return tuple(sorted((k, str(v)) for k, v in json.loads(raw).items()))


# A reading of a counter is its cumulative value; so is one of an event counter, which only
# arrives as a reading when a rank exported it over OTLP (the agent's ingest).
_OP_FOR_INSTRUMENT = {"gauge": Op.SET, "counter": Op.SET, "event": Op.SET, "histogram": Op.OBSERVE}
_STEP_COLUMNS = [f.name for f in fields(StepRecord)]


def batch_updates(
    batch: Batch, catalogue: Catalogue, *, every_reading: bool = False
) -> Iterator[Update]:
    """Every instrument update a batch implies: each histogram observation in time order,
    then one update per other series (a gauge's or cumulative counter's last reading, a
    step counter's increments summed). A scrape or an export shows no more than that, and a
    rank's 2 s window at 50 ms is over a thousand readings and 48 step rows, whose updates
    one by one (an OTel SDK call each) cost the flush thread more than its Parquet write
    (bench/exporters.py). `every_reading=True` yields every reading and step value as its
    own update, the same exposition at more cost: what the sinks did before 2026-11-25,
    kept for the benchmark. A cumulative counter that went down inside one window (a
    reset) is seen only at its last reading."""
    samples = batch.samples
    if samples.num_rows:
        # Keyed by the parsed attributes: one series sent as two JSON texts is still one.
        held: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Metric, float]] = {}
        for name, value, raw in zip(
            samples["metric"].to_pylist(),
            samples["value"].to_pylist(),
            samples["attrs"].to_pylist(),
        ):
            metric = catalogue.metrics.get(name)
            if metric is None:
                continue
            op = _OP_FOR_INSTRUMENT[metric.instrument]
            attrs = _attrs(raw)
            if every_reading or op is Op.OBSERVE:
                yield Update(metric, attrs, op, value)
            else:
                held[(name, attrs)] = (metric, value)
        for (_, attrs), (metric, value) in held.items():
            yield Update(metric, attrs, Op.SET, value)
    yield from _step_updates(batch.steps, catalogue, every_reading)
    for event in batch.events:
        counter = EVENT_COUNTERS.get(event.kind)
        if counter:
            attrs = (("kind", event.name), ("severity", event.severity))
            yield Update(catalogue[counter], attrs, Op.ADD, 1.0)
        if event.kind == "checkpoint":
            for key, name in CHECKPOINT_EVIDENCE.items():
                if isinstance(event.evidence.get(key), (int, float)):
                    metric = catalogue[name]
                    op = _OP_FOR_INSTRUMENT[metric.instrument]
                    yield Update(metric, (), op, float(event.evidence[key]))


def _step_updates(
    steps: list[StepRecord], catalogue: Catalogue, every_reading: bool
) -> Iterator[Update]:
    """The step rows' updates: every histogram observation in step order, then (unless
    `every_reading`) one update per series for the rest: a gauge's last value, a counter's
    increments summed. A window of 48 steps is otherwise 48 updates per gauge and counter."""
    step_metrics = [m for m in catalogue.in_table("steps") if m.store_column in _STEP_COLUMNS]
    held: dict[tuple[str, tuple[tuple[str, str], ...]], Update] = {}
    for step in steps:
        level = (("trainspec.compression.level", step.compression),) if step.compression else ()
        for metric in step_metrics:
            value = getattr(step, metric.store_column or "")
            if value is None:
                continue
            op = Op.ADD if metric.instrument == "counter" else _OP_FOR_INSTRUMENT[metric.instrument]
            attrs = level if metric.name == "trainspec.comm.bytes" else ()
            update = Update(metric, attrs, op, float(value))
            if every_reading or op is Op.OBSERVE:
                yield update
                continue
            key = (metric.name, attrs)
            before = held.get(key)
            if op is Op.ADD and before is not None:
                update = Update(metric, attrs, op, before.value + update.value)
            held[key] = update
    yield from held.values()
