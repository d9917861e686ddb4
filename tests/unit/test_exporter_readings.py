"""What the exporters take of a flush (collector/aggregate.py `batch_updates`): every
histogram observation, the last reading of each other series and a step counter's sum, with
the same exposition as feeding every reading and step value one at a time."""

from __future__ import annotations

import pyarrow as pa

from trainspec.collector.aggregate import Op, Update, batch_updates
from trainspec.collector.records import Batch, StepRecord, attrs_json
from trainspec.collector.sinks.otel import OTelSink
from trainspec.collector.sinks.prometheus import PrometheusState
from trainspec.schema import load_catalogue
from trainspec.store.tables import SAMPLES

CATALOGUE = load_catalogue()
GPU0, GPU1 = attrs_json({"gpu.index": 0}), attrs_json({"gpu.index": 1})


def _samples(rows: list[tuple[float, str, float, str]]) -> pa.Table:
    ts, metric, value, attrs = (list(col) for col in zip(*rows))
    return pa.Table.from_arrays(
        [
            pa.array(ts, pa.float64()),
            pa.array([0] * len(rows), pa.int32()),
            pa.array(metric, pa.string()),
            pa.array(value, pa.float64()),
            pa.array(attrs, pa.string()),
        ],
        schema=SAMPLES,
    )


def _window() -> list[tuple[float, str, float, str]]:
    """40 ticks of a 2 s window: two GPUs' utilization, RSS, a cumulative energy counter and
    the probe's latency histogram."""
    rows = []
    for k in range(40):
        t = 1000.0 + 0.05 * k
        rows.append((t, "trainspec.gpu.utilization", k / 40, GPU0))
        rows.append((t, "trainspec.gpu.utilization", 1 - k / 40, GPU1))
        rows.append((t, "trainspec.process.memory.rss", 1e9 + k, "{}"))
        rows.append((t, "trainspec.gpu.energy", 10.0 * k, GPU0))
        rows.append((t, "trainspec.comm.probe.latency", 1e-4 * (k + 1), "{}"))
    return rows


def _updates(rows: list[tuple[float, str, float, str]], steps=()) -> list[Update]:
    return list(batch_updates(Batch(_samples(rows), list(steps), []), CATALOGUE))


def test_keeps_the_last_reading_per_series_and_every_histogram_observation() -> None:
    updates = _updates(_window())
    names = [u.metric.name for u in updates]
    assert names.count("trainspec.comm.probe.latency") == 40
    assert names.count("trainspec.gpu.utilization") == 2  # one per GPU
    assert names.count("trainspec.process.memory.rss") == 1
    assert names.count("trainspec.gpu.energy") == 1
    last = {(u.metric.name, u.attrs): u.value for u in updates if u.op is Op.SET}
    gpu0, gpu1 = (("gpu.index", "0"),), (("gpu.index", "1"),)
    assert last[("trainspec.gpu.utilization", gpu0)] == 39 / 40
    assert last[("trainspec.gpu.utilization", gpu1)] == 1 - 39 / 40
    assert last[("trainspec.gpu.energy", gpu0)] == 390.0
    latencies = [u.value for u in updates if u.op is Op.OBSERVE]
    assert latencies == [1e-4 * (k + 1) for k in range(40)]  # in the order they came


def _steps(n: int) -> list[StepRecord]:
    return [
        StepRecord(ts=float(k), rank=0, step=k, duration_s=0.04 + k / 1000, samples=16,
                   loss=2.0 - k / 100, comm_bytes=1000, compression="int8" if k % 2 else "none")
        for k in range(n)
    ]  # fmt: skip


def test_step_rows_give_observations_each_and_one_update_per_other_series() -> None:
    updates = _updates([(0.0, "trainspec.host.memory.used", 1.0, "{}")], _steps(10))
    durations = [u.value for u in updates if u.metric.name == "trainspec.step.duration"]
    assert durations == [0.04 + k / 1000 for k in range(10)]
    samples = [u for u in updates if u.metric.name == "trainspec.step.samples"]
    assert [(u.op, u.value) for u in samples] == [(Op.ADD, 160.0)]
    loss = [u.value for u in updates if u.metric.name == "trainspec.step.loss"]
    assert loss == [2.0 - 9 / 100]
    level = "trainspec.compression.level"
    comm = {u.attrs: u.value for u in updates if u.metric.name == "trainspec.comm.bytes"}
    assert comm == {((level, "none"),): 5000.0, ((level, "int8"),): 5000.0}


def test_updates_per_flush_no_longer_grow_with_the_ticks() -> None:
    updates = _updates(_window())
    assert sum(u.op is Op.OBSERVE for u in updates) == 40
    assert sum(u.op is Op.SET for u in updates) == 4  # 2 GPUs' utilization, RSS, energy


def test_exposition_equals_feeding_every_reading_alone() -> None:
    batch = Batch(_samples(_window()), _steps(48), [])
    one_by_one = PrometheusState(CATALOGUE, {"service.name": "t"})
    one_by_one.apply(batch_updates(batch, CATALOGUE, every_reading=True))
    batched = PrometheusState(CATALOGUE, {"service.name": "t"})
    batched.apply(batch_updates(batch, CATALOGUE))

    def exposition(state: PrometheusState) -> list[tuple[str, dict, float]]:
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for family in state.families()
            for s in family.samples
        )

    assert exposition(batched) == exposition(one_by_one)


def test_an_empty_window_stays_empty() -> None:
    empty = SAMPLES.empty_table()
    assert list(batch_updates(Batch(empty, [], []), CATALOGUE)) == []


def _otel_export(every_reading: bool) -> dict[tuple[str, tuple], tuple]:
    from tests.unit.test_sinks import RecordingExporter

    exporter = RecordingExporter()
    sink = OTelSink({"service.name": "t"}, exporter=exporter, export_interval_ms=60_000,
                    environ={})  # fmt: skip
    # Two windows: counters' deltas and sums carry across them. The cumulative counter rises
    # throughout (a reset inside a window is seen only at its last reading, documented).
    for k in range(2):
        rows = [(t + 2 * k, m, v + 1000 * k, a) for t, m, v, a in _window()]
        sink.record(batch_updates(Batch(_samples(rows), _steps(48), []), CATALOGUE,
                                  every_reading=every_reading))  # fmt: skip
    sink.flush()
    points = {}
    for data in exporter.exports:
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        key = (m.name, tuple(sorted(p.attributes.items())))
                        value = getattr(p, "value", None)
                        hist = (p.count, p.sum, tuple(p.bucket_counts)) if value is None else ()
                        points[key] = (value, hist)
    sink.close(timeout_s=1.0)
    return points


def test_otel_export_equals_recording_every_reading() -> None:
    assert _otel_export(every_reading=False) == _otel_export(every_reading=True)
