"""Turn a batch into instrument updates for the aggregating exporters (OTel, Prometheus).

The store keeps every raw reading; exporters get what their stacks expect: gauges keep the
last value of the window, counters their cumulative value, histograms every observation in
explicit second-scale buckets (the OTel default buckets suit milliseconds, not seconds).
One table of rules serves both exporters, so they cannot disagree.
"""

from __future__ import annotations

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
    d = json.loads(raw) if isinstance(raw, str) else raw
    return tuple(sorted((k, str(v)) for k, v in d.items()))


_OP_FOR_INSTRUMENT = {"gauge": Op.SET, "counter": Op.SET, "histogram": Op.OBSERVE}
_STEP_COLUMNS = [f.name for f in fields(StepRecord)]


def batch_updates(batch: Batch, catalogue: Catalogue) -> Iterator[Update]:
    """Every instrument update a batch implies, in time order within each table."""
    samples = batch.samples
    if samples.num_rows:
        for name, value, raw in zip(
            samples["metric"].to_pylist(),
            samples["value"].to_pylist(),
            samples["attrs"].to_pylist(),
        ):
            metric = catalogue.metrics.get(name)
            if metric is not None:
                yield Update(metric, _attrs(raw), _OP_FOR_INSTRUMENT[metric.instrument], value)
    step_metrics = [m for m in catalogue.in_table("steps") if m.store_column in _STEP_COLUMNS]
    for step in batch.steps:
        level = (("trainspec.compression.level", step.compression),) if step.compression else ()
        for metric in step_metrics:
            value = getattr(step, metric.store_column or "")
            if value is None:
                continue
            op = Op.ADD if metric.instrument == "counter" else _OP_FOR_INSTRUMENT[metric.instrument]
            attrs = level if metric.name == "trainspec.comm.bytes" else ()
            yield Update(metric, attrs, op, float(value))
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
