"""Synthetic runs shaped like a real multi-rank job, for the dashboard's tests and benchmark.

    make_dashboard_run(tmp_path / "run-a", ranks=3, seconds=60.0, straggler=2)

What a run holds, per rank, written through SegmentWriter as a job's ranks would:
- 50 ms samples of `trainspec.process.cpu.utilization`, `trainspec.memory.pressure` and
  `trainspec.comm.probe.latency` (plus GPU series when `gpus=True`);
- one `steps` row per step: phases, communication, gradient statistics. The straggler rank
  computes ~1.6x longer; the other ranks wait for it in `comm_exposed_s` (part of backward,
  as the catalogue defines it), as DDP ranks do, so every rank's step duration is about the
  same and only the split tells them apart;
- events: a straggler anomaly, a rebalance action (after which the straggler gets fewer
  samples and catches up), a compression action, a loss-spike anomaly and checkpoints.
Values come from a seeded generator: the same arguments give the same run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainspec.store import SegmentWriter
from trainspec.store.tables import TABLES, to_arrow

T0 = 1_700_000_000.0
SAMPLE_PERIOD_S = 0.05
STEP_PERIOD_S = 0.25
BASE_METRICS = (
    "trainspec.process.cpu.utilization",
    "trainspec.memory.pressure",
    "trainspec.comm.probe.latency",
)
GPU_METRICS = ("trainspec.gpu.utilization", "trainspec.gpu.memory.used", "trainspec.gpu.power")


def _hw_id(index: int) -> str:
    return f"GPU-{index:08d}-0000-0000-0000-000000000000"


def _slow(rank: int, straggler: int | Sequence[int]) -> bool:
    return rank in np.atleast_1d(straggler)


def _sample_values(
    metric: str, t: np.ndarray, rank: int, straggler: int | Sequence[int], rng
) -> np.ndarray:
    n = len(t)
    if metric == "trainspec.process.cpu.utilization":
        base = 0.78 if _slow(rank, straggler) else 0.55
        return np.clip(base + 0.05 * np.sin(t / 3.0) + rng.normal(0, 0.03, n), 0, 1)
    if metric == "trainspec.memory.pressure":
        saw = (t % 40.0) / 40.0  # allocations build up and are released every ~40 s
        return np.clip(0.35 + 0.25 * saw + 0.02 * rank + rng.normal(0, 0.005, n), 0, 1)
    if metric == "trainspec.comm.probe.latency":
        lat = rng.lognormal(np.log(150e-6), 0.2, n)
        spikes = rng.random(n) < 0.01  # an occasional slow probe, as on a shared host
        return np.where(spikes, lat * 8, lat)
    if metric == "trainspec.gpu.utilization":
        return np.clip(0.9 - (0 if _slow(rank, straggler) else 0.25) + rng.normal(0, 0.03, n), 0, 1)
    if metric == "trainspec.gpu.memory.used":
        return 30e9 + 5e9 * ((t % 40.0) / 40.0) + rng.normal(0, 1e7, n)
    if metric == "trainspec.gpu.power":
        return 300 + 60 * np.sin(t / 5.0) + rng.normal(0, 5, n)
    raise ValueError(f"no synthetic shape for {metric}")


def samples_table(
    rank: int, seconds: float, straggler: int | Sequence[int], gpus: bool, rng
) -> pa.Table:
    t = np.arange(0.0, seconds, SAMPLE_PERIOD_S)
    t = t + rng.uniform(-0.003, 0.003, len(t))  # sampler threads are scheduled, not exact
    metrics = BASE_METRICS + (GPU_METRICS if gpus else ())
    attrs = json.dumps({"gpu.index": rank, "hw.id": _hw_id(rank)}) if gpus else "{}"
    parts = []
    for metric in metrics:
        parts.append(
            pa.table(
                {
                    "ts": T0 + t,
                    "rank": pa.array(np.full(len(t), rank), pa.int32()),
                    "metric": pa.array([metric] * len(t), pa.string()),
                    "value": _sample_values(metric, t, rank, straggler, rng),
                    "attrs": pa.array(
                        [attrs if metric.startswith("trainspec.gpu") else "{}"] * len(t)
                    ),
                },
                schema=TABLES["samples"],
            )
        )
    return pa.concat_tables(parts).sort_by("ts")


def steps_table(ranks: int, seconds: float, straggler: int | Sequence[int], rng) -> pa.Table:
    """Every rank's steps; `straggler` is one slow rank or several (a slow node's)."""
    slow_ranks = np.atleast_1d(straggler)
    n = int(seconds / STEP_PERIOD_S)
    step = np.arange(n)
    rebalanced = step >= n // 2  # the rebalance action lands half-way
    shares = np.where(rebalanced[:, None], 36, 32) * np.ones((n, ranks))
    shares[:, slow_ranks] = np.where(rebalanced, 24, 32)[:, None]
    slow = np.ones(ranks)
    slow[slow_ranks] = 1.6
    per_sample = 0.0042 * slow[None, :] * (1 + rng.normal(0, 0.03, (n, ranks)))
    compute = per_sample * shares
    forward = 0.38 * compute
    data_wait = np.abs(rng.normal(0.004, 0.001, (n, ranks)))
    optimizer = np.full((n, ranks), 0.01)
    allreduce = np.abs(rng.normal(0.006, 0.0005, (n, ranks)))
    ready = data_wait + compute
    comm_exposed = ready.max(axis=1, keepdims=True) - ready + 0.002
    # Backward includes the wait for gradient synchronization, as the catalogue defines it.
    backward = 0.62 * compute + comm_exposed
    duration = data_wait + forward + backward + optimizer
    loss = 3.2 * np.exp(-step / (n / 3)) + 0.8 + rng.normal(0, 0.02, n)
    loss[int(n * 0.7)] += 1.5  # the loss spike the anomaly event points at
    noise_scale = 150 + 400 * step / max(n, 1) + rng.normal(0, 10, n)
    grad_norm = 1.5 * np.exp(-step / n) + rng.normal(0, 0.02, n)
    compression = np.where(step >= int(n * 0.8), "int8", "none")
    cols: dict[str, list] = {c: [] for c in TABLES["steps"].names}
    for r in range(ranks):
        cols["ts"] += list(T0 + (step + 1) * STEP_PERIOD_S)
        cols["rank"] += [r] * n
        cols["step"] += list(step)
        cols["duration_s"] += list(duration[:, r])
        cols["data_wait_s"] += list(data_wait[:, r])
        cols["forward_s"] += list(forward[:, r])
        cols["backward_s"] += list(backward[:, r])
        cols["optimizer_s"] += list(optimizer[:, r])
        cols["comm_exposed_s"] += list(comm_exposed[:, r])
        cols["allreduce_s"] += list(allreduce[:, r])
        cols["samples"] += list(shares[:, r].astype(int))
        cols["tokens"] += list(shares[:, r].astype(int) * 64)
        cols["throughput"] += list(shares[:, r] / duration[:, r])
        cols["loss"] += list(loss)
        cols["mfu"] += [None] * n
        cols["grad_norm"] += list(grad_norm)
        cols["grad_variance"] += list(noise_scale * grad_norm**2)
        cols["grad_noise_scale"] += list(noise_scale)
        cols["comm_bytes"] += list(np.where(compression == "int8", 1_000_000, 4_000_000))
        cols["compression"] += list(compression)
    return to_arrow("steps", cols)


def _event(rank: int, step: int, kind: str, name: str, severity: str, reason: str, **extra):
    return {
        "ts": T0 + (step + 1) * STEP_PERIOD_S,
        "rank": rank,
        "step": step,
        "kind": kind,
        "name": name,
        "severity": severity,
        "reason": reason,
        "evidence": json.dumps(extra.get("evidence", {})),
        "before": json.dumps(extra["before"]) if "before" in extra else None,
        "after": json.dumps(extra["after"]) if "after" in extra else None,
    }


def events_rows(ranks: int, seconds: float, straggler: int) -> list[dict]:
    n = int(seconds / STEP_PERIOD_S)
    half, spike, squeeze = n // 2, int(n * 0.7), int(n * 0.8)
    out = []
    for r in range(ranks):
        out.append(
            _event(
                r, half - 1, "anomaly", "straggler", "warning",
                f"rank {straggler} compute is 1.6x the median of the other ranks",
                evidence={"rank": straggler, "ratio": 1.6, "window_steps": 20},
            )
        )  # fmt: skip
        out.append(
            _event(
                r, half, "action", "rebalance", "info",
                f"shift samples away from straggler rank {straggler}",
                evidence={"ratio": 1.6},
                before={"shares": [32] * ranks},
                after={"shares": [24 if i == straggler else 36 for i in range(ranks)]},
            )
        )  # fmt: skip
        out.append(
            _event(
                r, spike, "anomaly", "loss_spike", "critical",
                "loss rose 1.5 above its moving average",
                evidence={"loss": 2.9, "ema": 1.4},
            )
        )  # fmt: skip
        out.append(
            _event(
                r, spike, "checkpoint", "anomaly", "info", "checkpoint after a loss spike",
                evidence={"duration_s": 0.8, "size_bytes": 48_000_000},
            )
        )  # fmt: skip
        out.append(
            _event(
                r, squeeze, "action", "compression", "info",
                "exposed communication above 20% of step time: compress gradients",
                evidence={"comm_exposed_share": 0.24},
                before={"level": "none"}, after={"level": "int8"},
            )
        )  # fmt: skip
    return out


def runs_rows(run_id: str, ranks: int, gpus: bool) -> list[dict]:
    return [
        {
            "run_id": run_id,
            "rank": r,
            "local_rank": r,
            "world_size": ranks,
            "host": "node-a",
            "started_at": T0,
            "device": "cuda" if gpus else "cpu",
            "gpus": json.dumps(
                [{"index": r, "uuid": _hw_id(r), "name": "NVIDIA H100"}] if gpus else []
            ),
            "config": json.dumps({"batch_size": 32}),
            "versions": json.dumps({"trainspec": "0.1.0"}),
        }
        for r in range(ranks)
    ]


def _write_chunks(run_dir: Path, table: str, rank: int, data: pa.Table, segments: int) -> None:
    writer = SegmentWriter(run_dir, table, f"rank-{rank}")
    size = max(1, -(-data.num_rows // segments))
    for start in range(0, data.num_rows, size):
        writer.write(data.slice(start, size))


def make_dashboard_run(
    run_dir: str | Path,
    *,
    ranks: int = 3,
    seconds: float = 60.0,
    straggler: int | None = None,
    gpus: bool = False,
    segments: int = 4,
    seed: int = 0,
) -> Path:
    """Write a synthetic run (see the module docstring); returns its directory."""
    run_dir = Path(run_dir)
    straggler = ranks - 1 if straggler is None else straggler
    rng = np.random.default_rng(seed)
    steps = steps_table(ranks, seconds, straggler, rng)
    events = to_arrow("events", _columns(events_rows(ranks, seconds, straggler)))
    runs = to_arrow("runs", _columns(runs_rows(run_dir.name, ranks, gpus)))
    for r in range(ranks):
        samples = samples_table(r, seconds, straggler, gpus, rng)
        _write_chunks(run_dir, "samples", r, samples, segments)
        for table, data in (("steps", steps), ("events", events), ("runs", runs)):
            mine = data.filter(pc.equal(data["rank"], r))
            _write_chunks(run_dir, table, r, mine, segments if table == "steps" else 1)
    return run_dir


def make_wide_run(
    run_dir: str | Path,
    *,
    ranks: int,
    seconds: float,
    straggler: int | Sequence[int] | None = None,
    samples: bool = True,
    seed: int = 0,
) -> Path:
    """A run of many ranks written fast: steps (and samples, unless `samples=False`) of
    every rank through one writer per table, no events. 1,024 ranks in about a second,
    where `make_dashboard_run` writes four writers' files per rank. `straggler` may name
    several slow ranks (a slow node's)."""
    run_dir = Path(run_dir)
    straggler = ranks - 1 if straggler is None else straggler
    rng = np.random.default_rng(seed)
    _write_chunks(run_dir, "steps", 0, steps_table(ranks, seconds, straggler, rng), 1)
    _write_chunks(
        run_dir, "runs", 0, to_arrow("runs", _columns(runs_rows(run_dir.name, ranks, False))), 1
    )
    if samples:
        parts = [samples_table(r, seconds, straggler, False, rng) for r in range(ranks)]
        _write_chunks(run_dir, "samples", 0, pa.concat_tables(parts), 1)
    return run_dir


def _set_values(table: pa.Table, values: dict[str, float]) -> pa.Table:
    for name, value in values.items():
        column = pa.array(np.full(table.num_rows, value), table.schema.field(name).type)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def append_steps(
    run_dir: str | Path,
    *,
    ranks: int,
    first_step: int,
    count: int,
    values: dict[str, float] | None = None,
) -> None:
    """Append `count` more steps per rank, as a live job's next flush would; `values` sets
    columns to one value in every appended row (`{"loss": math.nan}`)."""
    rng = np.random.default_rng(first_step)
    steps = steps_table(ranks, count * STEP_PERIOD_S, ranks - 1, rng)
    shifted = steps.set_column(
        steps.schema.get_field_index("step"),
        "step",
        pc.add(steps["step"], first_step),
    ).set_column(0, "ts", pc.add(steps["ts"], first_step * STEP_PERIOD_S))
    shifted = _set_values(shifted, values or {})
    for r in range(ranks):
        mine = shifted.filter(pc.equal(shifted["rank"], r))
        _write_chunks(Path(run_dir), "steps", r, mine, 1)


def append_samples(
    run_dir: str | Path, *, rank: int, metric: str, values: list[float], at_s: float,
    attrs: str = "{}",
) -> None:  # fmt: skip
    """Append samples of `metric` for `rank`, one per SAMPLE_PERIOD_S from `at_s` seconds in."""
    n = len(values)
    table = pa.table(
        {
            "ts": T0 + at_s + SAMPLE_PERIOD_S * np.arange(n),
            "rank": pa.array(np.full(n, rank), pa.int32()),
            "metric": pa.array([metric] * n, pa.string()),
            "value": pa.array(values, pa.float64()),
            "attrs": pa.array([attrs] * n, pa.string()),
        },
        schema=TABLES["samples"],
    )
    _write_chunks(Path(run_dir), "samples", rank, table, 1)


def samples_per_second(ranks: int, gpus: bool = False) -> float:
    """Rows the samples table gains per second of run: to size a run by its row count."""
    metrics = len(BASE_METRICS) + (len(GPU_METRICS) if gpus else 0)
    return ranks * metrics / SAMPLE_PERIOD_S


def _columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0]}
