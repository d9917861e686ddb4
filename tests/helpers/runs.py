"""Synthetic trainspec runs for tests: compliant by default, with knobs to break them.

    run = synthetic_run(ranks=2, seconds=3.0, gpus=False)     # rows in memory
    break_run(run, slow_metric="trainspec.process.cpu.utilization", slow_period_s=0.5)
    write_run(tmp_path / "run", run)                          # through SegmentWriter

`make_compliant_run(dir, ranks=2, seconds=3.0, gpus=False)` does the first and last step.
Every required catalogue metric is sampled at its catalogue interval (per-step metrics on
every step), with small deterministic jitter, so `trainspec validate` passes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from trainspec.schema import Metric, load_catalogue
from trainspec.schema.targets.model import RankInfo
from trainspec.schema.validate import is_required
from trainspec.store import SegmentWriter
from trainspec.store.tables import to_arrow

T0 = 1_700_000_000.0
STEP_PERIOD_S = 0.1
UNIT_VALUES = {"1": 0.4, "By": 2.0e9, "W": 250.0, "Cel": 61.0, "Hz": 1.41e9, "s": 1.5e-4, "J": 0.0}


@dataclass
class SyntheticRun:
    ranks: int
    seconds: float
    gpus: bool
    samples: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)

    def metrics_present(self) -> set[str]:
        return {r["metric"] for r in self.samples}


def sampled_metrics(ranks: int, gpus: bool) -> list[Metric]:
    """The samples-table metrics a compliant run of this shape must carry."""
    info = RankInfo(gpu=gpus, cuda=gpus)
    cat = load_catalogue()
    return [m for m in cat.in_table("samples") if is_required(m, info, ranks)]


def gpu_attrs(index: int) -> dict[str, object]:
    return {"gpu.index": index, "hw.id": f"GPU-{index:08d}-0000-0000-0000-000000000000"}


def metric_attrs(metric: Metric, gpu_index: int) -> dict[str, object]:
    attrs: dict[str, object] = {}
    if "gpu.index" in metric.required_attributes:
        attrs["gpu.index"] = gpu_index
    if "hw.id" in metric.required_attributes:
        attrs["hw.id"] = gpu_attrs(gpu_index)["hw.id"]
    if "direction" in metric.required_attributes:
        attrs["direction"] = "tx"
    return attrs


def metric_value(metric: Metric, i: int) -> float:
    """A plausible in-range value; counters grow with the sample index i."""
    if metric.instrument == "counter":
        return float(i * 3)
    base = UNIT_VALUES.get(metric.unit, 0.0 if "bitmask" in metric.unit else 1.0)
    if metric.unit == "1":
        return 0.4 + 0.3 * math.sin(i / 7.0)
    return base * (1.0 + 0.01 * math.sin(i / 5.0))


def _jitter(i: int) -> float:
    return ((i * 7919) % 11 - 5) * 0.001  # deterministic, within +-5 ms


def synthetic_run(ranks: int = 2, seconds: float = 3.0, gpus: bool = False) -> SyntheticRun:
    run = SyntheticRun(ranks, seconds, gpus)
    for rank in range(ranks):
        run.runs.append(
            {
                "run_id": "synthetic",
                "rank": rank,
                "local_rank": rank,
                "world_size": ranks,
                "host": "testhost",
                "started_at": T0,
                "device": "cuda" if gpus else "cpu",
                "gpus": json.dumps(
                    [{"index": rank, "uuid": gpu_attrs(rank)["hw.id"]}] if gpus else []
                ),
                "config": "{}",
                "versions": "{}",
            }
        )
        for metric in sampled_metrics(ranks, gpus):
            period = metric.interval_s or 1.0
            attrs = json.dumps(metric_attrs(metric, rank))
            for i in range(int(seconds / period) + 1):
                jitter = _jitter(i) if period <= 0.1 else 0.0
                run.samples.append(
                    {
                        "ts": T0 + i * period + jitter,
                        "rank": rank,
                        "metric": metric.name,
                        "value": metric_value(metric, i),
                        "attrs": attrs,
                    }
                )
        distributed = ranks > 1
        for step in range(int(seconds / STEP_PERIOD_S)):
            run.steps.append(
                {
                    "ts": T0 + (step + 1) * STEP_PERIOD_S,
                    "rank": rank,
                    "step": step,
                    "duration_s": 0.09,
                    "data_wait_s": 0.002,
                    "forward_s": 0.03,
                    "backward_s": 0.045,
                    "optimizer_s": 0.01,
                    "comm_exposed_s": 0.004 if distributed else None,
                    "allreduce_s": 0.006 if distributed else None,
                    "samples": 32,
                    "tokens": 32 * 64,
                    "throughput": 32 / 0.09,
                    "loss": 3.0 - 0.01 * step,
                    "mfu": None,
                    "grad_norm": 1.2,
                    "grad_variance": 0.3 if distributed else None,
                    "grad_noise_scale": 120.0 if distributed else None,
                    "comm_bytes": 4_000_000 if distributed else None,
                    "compression": "none",
                }
            )
        run.events.append(
            {
                "ts": T0 + 1.0,
                "rank": rank,
                "step": 10,
                "kind": "checkpoint",
                "name": "periodic",
                "severity": "info",
                "reason": "Young/Daly interval reached",
                "evidence": json.dumps({"duration_s": 0.2, "size_bytes": 1000}),
                "before": None,
                "after": None,
            }
        )
    return run


def break_run(
    run: SyntheticRun,
    *,
    drop_rank: int | None = None,
    slow_metric: str | None = None,
    slow_period_s: float = 0.5,
    nan_metric: str | None = None,
    counter_down: str | None = None,
    out_of_range: str | None = None,
    drop_metric: str | None = None,
    bad_event: bool = False,
) -> SyntheticRun:
    """Break a synthetic run in place, one way per knob; returns it for chaining."""
    if drop_rank is not None:
        run.samples = [r for r in run.samples if r["rank"] != drop_rank]
        run.steps = [r for r in run.steps if r["rank"] != drop_rank]
        run.events = [r for r in run.events if r["rank"] != drop_rank]
    if drop_metric is not None:
        run.samples = [r for r in run.samples if r["metric"] != drop_metric]
    if slow_metric is not None:
        keep, last = [], {}
        for r in sorted(run.samples, key=lambda r: r["ts"]):
            key = (r["metric"], r["rank"])
            if r["metric"] == slow_metric and r["ts"] - last.get(key, -1e18) < slow_period_s - 0.01:
                continue
            last[key] = r["ts"]
            keep.append(r)
        run.samples = keep
    rows_of = {
        m: [r for r in run.samples if r["metric"] == m]
        for m in (nan_metric, counter_down, out_of_range)
        if m
    }
    if nan_metric:
        rows_of[nan_metric][len(rows_of[nan_metric]) // 2]["value"] = float("nan")
    if counter_down:
        rows = sorted((r for r in rows_of[counter_down] if r["rank"] == 0), key=lambda r: r["ts"])
        rows[-1]["value"] = rows[-2]["value"] - 1.0  # the last point drops below its predecessor
    if out_of_range:
        rows_of[out_of_range][0]["value"] = (
            1.7 if load_catalogue()[out_of_range].unit == "1" else -5.0
        )
    if bad_event:
        run.events.append(
            {
                "ts": T0 + 2.0,
                "rank": 0,
                "step": 20,
                "kind": "explosion",
                "name": "x",
                "severity": "info",
                "reason": "",
                "evidence": "{not json",
                "before": None,
                "after": None,
            }
        )
    return run


def write_run(run_dir: str | Path, run: SyntheticRun, *, segments_per_rank: int = 3) -> Path:
    """Write a synthetic run through SegmentWriter, a few segments per rank and table."""
    run_dir = Path(run_dir)
    tables = {"samples": run.samples, "steps": run.steps, "events": run.events, "runs": run.runs}
    for table, rows in tables.items():
        for rank in sorted({r["rank"] for r in rows}):
            mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r.get("ts") or 0)
            writer = SegmentWriter(run_dir, table, f"rank-{rank}")
            n = max(1, math.ceil(len(mine) / segments_per_rank))
            for start in range(0, len(mine), n):
                chunk = mine[start : start + n]
                writer.write(to_arrow(table, {k: [r[k] for r in chunk] for k in chunk[0]}))
    (run_dir / "segments").mkdir(parents=True, exist_ok=True)
    return run_dir


def make_compliant_run(
    run_dir: str | Path, ranks: int = 2, seconds: float = 3.0, gpus: bool = False, **breaks
) -> Path:
    """Write a compliant synthetic run (or a broken one: keyword arguments of `break_run`)."""
    run = synthetic_run(ranks, seconds, gpus)
    if breaks:
        break_run(run, **breaks)
    return write_run(run_dir, run)
