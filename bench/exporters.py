"""The exporters' share of a flush: a rank's 2 s window handed to the Prometheus and
OpenTelemetry sinks, every raw reading (how the sinks took it before 2026-11-25) against only
what a scrape or an export can show (`collector/aggregate.py` `latest_readings`: the last
reading per gauge or counter series, every histogram observation), alternated A B A B.

Two windows at 50 ms sampling (40 ticks) with the 48 step rows of a 42 ms step: a CPU rank
(the host sampler's 6 series and the latency probe's histogram) and a GPU rank (NVML's 16
series on each of 2 GPUs, the allocator's 4, host and probe as on CPU). Reported per flush:
the calling thread's CPU (the flush thread shares the cores with training). Both ways give
the same exposition (tests/unit/test_exporter_readings.py).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult  # noqa: E402

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402
from trainspec.collector.aggregate import batch_updates  # noqa: E402
from trainspec.collector.records import Batch, StepRecord, attrs_json  # noqa: E402
from trainspec.collector.sinks.otel import OTelSink  # noqa: E402
from trainspec.collector.sinks.prometheus import PrometheusState  # noqa: E402
from trainspec.schema import load_catalogue  # noqa: E402
from trainspec.store.tables import SAMPLES  # noqa: E402

TICKS, STEPS_PER_FLUSH = 40, 48
HOST = [
    "trainspec.process.cpu.utilization",
    "trainspec.host.cpu.utilization",
    "trainspec.process.memory.rss",
    "trainspec.host.memory.used",
    "trainspec.host.memory.limit",
    "trainspec.memory.pressure",
]
NVML = [
    "trainspec.gpu.utilization",
    "trainspec.gpu.memory.utilization",
    "trainspec.gpu.memory.used",
    "trainspec.gpu.memory.limit",
    "trainspec.gpu.power",
    "trainspec.gpu.energy",
    "trainspec.gpu.temperature",
    "trainspec.gpu.clock.sm",
    "trainspec.gpu.throttle_reasons",
    "trainspec.gpu.errors.ecc",
    "trainspec.gpu.errors.xid",
    "trainspec.gpu.errors.remapped_rows",
    "trainspec.gpu.pcie.throughput",
    "trainspec.gpu.nvlink.throughput",
]
ALLOCATOR = [
    "trainspec.memory.allocator.allocated",
    "trainspec.memory.allocator.reserved",
    "trainspec.memory.allocator.fragmentation",
    "trainspec.memory.allocator.alloc_retries",
]
PROBE = "trainspec.comm.probe.latency"


class _DiscardingExporter(MetricExporter):
    """Takes every export and sends nothing: the bench times recording, not the network."""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def window(series: list[tuple[str, str]], rng: random.Random) -> Batch:
    t0 = time.time()
    rows: dict[str, list] = {"ts": [], "rank": [], "metric": [], "value": [], "attrs": []}
    for tick in range(TICKS):
        for name, attrs in [*series, (PROBE, attrs_json())]:
            rows["ts"].append(t0 + 0.05 * tick)
            rows["rank"].append(0)
            rows["metric"].append(name)
            rows["value"].append(rng.random())
            rows["attrs"].append(attrs)
    samples = pa.Table.from_pydict(rows, schema=SAMPLES)
    steps = [
        StepRecord(ts=t0 + 0.042 * k, rank=0, step=k, duration_s=0.042, data_wait_s=0.001,
                   forward_s=0.01, backward_s=0.025, optimizer_s=0.004, samples=16,
                   tokens=1024, throughput=380.0, loss=2.0, grad_norm=1.0, compression="none",
                   comm_bytes=1_900_000)
        for k in range(STEPS_PER_FLUSH)
    ]  # fmt: skip
    return Batch(samples, steps, [])


def windows(rng: random.Random) -> dict[str, Batch]:
    none = attrs_json()
    cpu = [(name, none) for name in HOST]
    gpus = [(name, attrs_json({"gpu.index": g})) for g in (0, 1) for name in NVML]
    return {
        "CPU rank": window(cpu, rng),
        "GPU rank, 2 GPUs": window(cpu + gpus + [(n, none) for n in ALLOCATOR], rng),
    }


def timed(flushes: int, flush: Callable[[], None]) -> float:
    """The calling thread's CPU per flush, in ms."""
    cpu0 = time.thread_time()
    for _ in range(flushes):
        flush()
    return 1e3 * (time.thread_time() - cpu0) / flushes


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rounds, flushes = (2, 20) if args.quick else (6, 100)
    catalogue = load_catalogue()
    batches = windows(random.Random(0))
    resource = {"service.name": "bench", "trainspec.rank": "0"}
    otel = OTelSink(resource, exporter=_DiscardingExporter(), export_interval_ms=3_600_000,
                    catalogue=catalogue)  # fmt: skip
    prom = PrometheusState(catalogue, resource)
    ways: dict[str, Callable[[Batch, bool], None]] = {
        "Prometheus": lambda b, every: prom.apply(batch_updates(b, catalogue, every_reading=every)),
        "OpenTelemetry": lambda b, every: otel.record(
            batch_updates(b, catalogue, every_reading=every)
        ),
    }
    rows: list[dict[str, Any]] = []
    for label, batch in batches.items():
        for sink, apply in ways.items():
            cpu: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds):
                for every in (True, False) if r % 2 == 0 else (False, True):
                    cpu[every].append(timed(flushes, lambda a=apply, b=batch, e=every: a(b, e)))
            ratios = [new / old for new, old in zip(cpu[False], cpu[True])]
            q1, med, q3 = quartiles(ratios)
            rows.append({
                "window": label,
                "sink": sink,
                "readings": batch.samples.num_rows,
                "every reading, cpu ms": quartiles(cpu[True])[1],
                "latest only, cpu ms": quartiles(cpu[False])[1],
                "ratio (q1-q3)": f"{med:.3f} ({q1:.3f}-{q3:.3f})",
            })  # fmt: skip
    otel.close(timeout_s=1.0)
    print_table(rows)
    write_json(args.json_path, {"rounds": rounds, "flushes_per_round": flushes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
