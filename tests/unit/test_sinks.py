"""One contract suite over every sink, plus what each sink's output reads back as."""

from __future__ import annotations

import shutil
import subprocess
import time

import pyarrow as pa
import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from prometheus_client.parser import text_string_to_metric_families

import trainspec.store as store
from trainspec.collector.records import Batch, EventRecord, StepRecord, attrs_json
from trainspec.collector.sinks.memory import InMemorySink
from trainspec.collector.sinks.otel import OTelSink
from trainspec.collector.sinks.prometheus import PrometheusSink
from trainspec.collector.sinks.store import StoreSink
from trainspec.store.tables import SAMPLES

RESOURCE = {"service.name": "test", "trainspec.run.id": "r1", "trainspec.rank": 0}


class RecordingExporter(MetricExporter):
    def __init__(self, result=MetricExportResult.SUCCESS):
        super().__init__()
        self.exports = []
        self.result = result

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exports.append(metrics_data)
        return self.result

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


def make_batch(t0: float = 1000.0, step0: int = 0) -> Batch:
    rows = [
        (t0, "trainspec.memory.pressure", 0.4, attrs_json()),
        (t0 + 0.05, "trainspec.memory.pressure", 0.6, attrs_json()),
        (t0, "trainspec.comm.probe.latency", 0.0002, attrs_json()),
        (t0 + 0.05, "trainspec.comm.probe.latency", 0.004, attrs_json()),
        (t0, "trainspec.telemetry.dropped", 3.0, attrs_json()),
    ]
    samples = pa.table(
        {
            "ts": [r[0] for r in rows],
            "rank": pa.array([0] * len(rows), pa.int32()),
            "metric": [r[1] for r in rows],
            "value": [r[2] for r in rows],
            "attrs": [r[3] for r in rows],
        },
        schema=SAMPLES,
    )
    steps = [
        StepRecord(
            ts=t0 + i,
            rank=0,
            step=step0 + i,
            duration_s=0.1 * (i + 1),
            samples=16,
            comm_bytes=1000,
            compression="int8",
        )
        for i in range(3)
    ]
    events = [
        EventRecord(
            ts=t0,
            rank=0,
            step=step0,
            kind="checkpoint",
            name="periodic",
            reason="Young/Daly interval",
            evidence={"duration_s": 1.5, "stall_s": 0.1, "bytes": 4096},
        ),
        EventRecord(
            ts=t0,
            rank=0,
            step=step0,
            kind="anomaly",
            name="straggler",
            reason="rank 1 slow",
            severity="warning",
        ),
    ]
    return Batch(samples=samples, steps=steps, events=events)


def _sinks(tmp_path):
    return {
        "store": lambda: StoreSink(tmp_path / "run", "rank-0"),
        "prometheus": lambda: PrometheusSink({k: str(v) for k, v in RESOURCE.items()}),
        "otel": lambda: OTelSink(
            RESOURCE, exporter=RecordingExporter(), export_interval_ms=60_000, environ={}
        ),
        "memory": InMemorySink,
    }


@pytest.mark.parametrize("name", ["store", "prometheus", "otel", "memory"])
def test_sink_contract(tmp_path, name):
    sink = _sinks(tmp_path)[name]()
    sink.write(make_batch())
    sink.write(make_batch(2000.0, step0=3))
    sink.flush(timeout_s=2.0)
    t0 = time.perf_counter()
    sink.close(timeout_s=2.0)
    sink.close(timeout_s=2.0)  # idempotent
    assert time.perf_counter() - t0 < 3.0


def test_store_sink_reads_back_through_duckdb(tmp_path):
    sink = StoreSink(tmp_path / "run", "rank-0")
    sink.write(make_batch())
    sink.close()
    con = store.open(tmp_path / "run")
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 5
    assert con.execute("SELECT sum(comm_bytes) FROM steps").fetchone()[0] == 3000
    assert (
        con.execute(
            "SELECT json_extract(evidence, '$.bytes')::INT FROM events WHERE kind='checkpoint'"
        ).fetchone()[0]
        == 4096
    )


def test_a_failed_merge_does_not_fail_a_stored_batch(tmp_path, monkeypatch):
    """A merge that ran out of disk raised out of write(): the collector counted the batch,
    already in its segments, as dropped."""
    from trainspec.store import SegmentWriter

    def no_space(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SegmentWriter, "merge", no_space)
    sink = StoreSink(tmp_path / "run", "rank-0")
    sink.write(make_batch())  # does not raise
    sink.write(make_batch())
    assert sink.merge_failures == 8  # four tables, two flushes
    monkeypatch.undo()
    sink.close()
    assert store.open(tmp_path / "run").execute("SELECT count(*) FROM samples").fetchone()[0] == 10


def test_a_table_that_fails_does_not_keep_the_others_rows_out(tmp_path, monkeypatch):
    """Samples, steps and events were written one after another: a steps write that failed
    (a full disk) left the batch's events unwritten, and the collector counted every point
    of the batch, samples already stored included, as dropped."""
    from trainspec.collector.collector import Collector
    from trainspec.collector.sink import PartialWrite

    sink = StoreSink(tmp_path / "run", "rank-0")
    steps_writer = sink._writers["steps"]

    def full(batch):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(steps_writer, "write", full)
    batch = make_batch()
    with pytest.raises(PartialWrite, match="steps: .*No space") as info:
        sink.write(batch)
    assert info.value.lost == len(batch.steps)
    con = store.open(tmp_path / "run")
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == batch.samples.num_rows
    assert con.execute("SELECT count(*) FROM events").fetchone()[0] == len(batch.events)

    collector = Collector(rank=0, samplers=[], sinks=[sink])
    for record in make_batch(3000.0, step0=7).steps:
        collector.record_step(record)
    collector.flush()
    assert collector.dropped["store"] == 3  # the steps only


def test_prometheus_exposition_parses_back(tmp_path):
    sink = PrometheusSink({k: str(v) for k, v in RESOURCE.items()})
    sink.write(make_batch())
    sink.write(make_batch(2000.0, step0=3))
    families = {f.name: f for f in text_string_to_metric_families(sink.exposition().decode())}
    gauge = families["trainspec_memory_pressure_ratio"]
    assert gauge.samples[0].value == 0.6  # last value of the window
    assert gauge.samples[0].labels["trainspec_rank"] == "0"
    hist = families["trainspec_step_duration_seconds"]
    count = next(s for s in hist.samples if s.name.endswith("_count"))
    assert count.value == 6
    bytes_total = families["trainspec_comm_bytes"]  # the parser strips _total
    sample = bytes_total.samples[0]
    assert sample.value == 6000 and sample.labels["trainspec_compression_level"] == "int8"
    actions = families["trainspec_anomalies"]
    assert actions.samples[0].labels["kind"] == "straggler" and actions.samples[0].value == 2
    sink.close()


def _otel_points(exporter):
    out = {}
    for data in exporter.exports:
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out[m.name] = (m, rm.resource.attributes)
    return out


def test_otel_sink_exports_second_scale_histograms_and_resource():
    exporter = RecordingExporter()
    sink = OTelSink(RESOURCE, exporter=exporter, export_interval_ms=60_000, environ={})
    sink.write(make_batch())
    sink.write(make_batch(2000.0, step0=3))
    sink.flush()
    points = _otel_points(exporter)
    metric, resource = points["trainspec.step.duration"]
    assert resource["trainspec.run.id"] == "r1" and resource["service.name"] == "test"
    hist = metric.data.data_points[0]
    assert hist.count == 6 and 1.0 in hist.explicit_bounds and 0.001 in hist.explicit_bounds
    assert metric.unit == "s"
    dropped, _ = points["trainspec.telemetry.dropped"]
    assert dropped.data.data_points[0].value == 3  # cumulative reading, not added twice
    sink.close()


def test_otel_failed_export_counts_drops():
    exporter = RecordingExporter(result=MetricExportResult.FAILURE)
    sink = OTelSink(RESOURCE, exporter=exporter, export_interval_ms=60_000, environ={})
    sink.write(make_batch())
    sink.flush()
    assert sink.dropped > 0
    sink.close()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's promtool not installed")
def test_prometheus_exposition_passes_promtool():
    sink = PrometheusSink({k: str(v) for k, v in RESOURCE.items()})
    sink.write(make_batch())
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=sink.exposition(), capture_output=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    sink.close()


def _gpu_power_batch() -> Batch:
    """Three GPUs of one metric whose readings carry different attribute keys."""
    rows = [
        (1000.0, "trainspec.gpu.power", 250.0, attrs_json({"gpu.index": 0, "hw.id": "GPU-a"})),
        (1000.0, "trainspec.gpu.power", 300.0,
         attrs_json({"gpu.index": 1, "trainspec.power.kind": "instant"})),
        (1000.0, "trainspec.gpu.power", 350.0, attrs_json({"gpu.index": 2})),
        (1000.0, "trainspec.step.forward", 0.1, attrs_json({"x": "a"})),
        (1000.0, "trainspec.step.forward", 0.2, attrs_json()),
    ]  # fmt: skip
    columns = list(zip(*rows))
    samples = pa.table(
        {"ts": columns[0], "rank": pa.array([0] * len(rows), pa.int32()), "metric": columns[1],
         "value": columns[2], "attrs": columns[3]},
        schema=SAMPLES,
    )  # fmt: skip
    return Batch(samples=samples, steps=[], events=[])


def test_prometheus_series_keep_their_own_label_names():
    """The family's label names came from its first series and the others' values were laid
    out under them by position: GPU 1 came out as hw_id="instant" and GPU 2 (one key fewer)
    was dropped. Each series keeps its own names, and the exposition stays lint-clean."""
    sink = PrometheusSink({k: str(v) for k, v in RESOURCE.items()})
    sink.write(_gpu_power_batch())
    body = sink.exposition()
    sink.close()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    resource = {"service_name": "test", "trainspec_run_id": "r1", "trainspec_rank": "0"}
    got = [(s.labels, s.value) for s in families["trainspec_gpu_power_watts"].samples]
    assert sorted(got, key=lambda x: x[1]) == [
        ({**resource, "gpu_index": "0", "hw_id": "GPU-a"}, 250.0),
        ({**resource, "gpu_index": "1", "trainspec_power_kind": "instant"}, 300.0),
        ({**resource, "gpu_index": "2"}, 350.0),
    ]
    counts = {
        s.labels.get("x"): s.value
        for s in families["trainspec_step_forward_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"a": 1, None: 1}  # a histogram's series too
    if shutil.which("promtool") is not None:
        proc = subprocess.run(
            ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30
        )
        assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc


def test_prometheus_an_empty_attribute_is_no_label():
    """Series keep their own label names, so {gpu_index="0",hw_id=""} would be exported
    beside {gpu_index="0"}: one series to Prometheus, twice in one scrape."""
    rows = [(1000.0, 0.5, {"gpu.index": 0, "hw.id": ""}), (1001.0, 0.7, {"gpu.index": 0})]
    samples = pa.table(
        {"ts": [r[0] for r in rows], "rank": pa.array([0, 0], pa.int32()),
         "metric": ["trainspec.gpu.utilization"] * 2, "value": [r[1] for r in rows],
         "attrs": [attrs_json(r[2]) for r in rows]},
        schema=SAMPLES,
    )  # fmt: skip
    sink = PrometheusSink({k: str(v) for k, v in RESOURCE.items()})
    sink.write(Batch(samples=samples, steps=[], events=[]))
    families = {f.name: f for f in text_string_to_metric_families(sink.exposition().decode())}
    sink.close()
    (sample,) = families["trainspec_gpu_utilization_ratio"].samples
    assert sample.value == 0.7 and "hw_id" not in sample.labels
