"""What the store's journal costs the collector's sampling thread (store/journal.py).

Each sampling tick appends its readings and the step records and events that arrived since
the last tick to the journal, so a killed process loses one tick of rows, not a flush
interval's. This drives a real `Collector` with a `StoreSink` on a temporary run, tick by
tick on this thread, with the journal on and off, alternated A B A B: per tick, 30 readings
(about what one rank's samplers give at 50 ms) and `--steps-per-tick` step records (1 for a
CPU-bound 40 ms step, 12 for a 4 ms GPU step); a flush every 40 ticks (2 s at 50 ms).
Reported: the thread's CPU per tick (`time.thread_time`), the flush's CPU per flush, and the
journal's CPU as a share of one core at a 50 ms tick.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402
from trainspec.collector import Collector, StepRecord  # noqa: E402
from trainspec.collector.sampler import Sampler  # noqa: E402
from trainspec.collector.sinks.store import StoreSink  # noqa: E402

SERIES, TICKS_PER_FLUSH, TICK_S = 30, 40, 0.05


class _Readings(Sampler):
    name = "bench"
    interval_s = TICK_S

    def __init__(self) -> None:
        self.names = [f"trainspec.bench.metric_{i}" for i in range(SERIES)]
        self.n = 0

    def sample(self, now: float) -> list[tuple[str, float, str]]:
        self.n += 1
        return [(m, self.n * 0.001 + i, '{"gpu.index":0}' if i % 3 else "{}")
                for i, m in enumerate(self.names)]  # fmt: skip


def one_round(journal: bool, ticks: int, steps_per_tick: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        sink = StoreSink(Path(tmp) / "run", "rank-0", journal_rank=0 if journal else None)
        sampler = _Readings()
        c = Collector(rank=0, samplers=[sampler], sinks=[sink], journal=sink.journal)
        tick_cpu, flush_cpu, step = 0.0, 0.0, 0
        for k in range(ticks):
            for _ in range(steps_per_tick):  # the training thread's records, made beforehand
                c.record_step(StepRecord(ts=time.time(), rank=0, step=step, duration_s=0.04,
                                         loss=2.5, grad_norm=1.0, samples=16))  # fmt: skip
                step += 1
            t0 = time.thread_time()
            c._run_sampler(sampler, time.time())  # what a tick of the sampling thread does
            c._journal_records()
            tick_cpu += time.thread_time() - t0
            if (k + 1) % TICKS_PER_FLUSH == 0:
                t0 = time.thread_time()
                c.flush()
                flush_cpu += time.thread_time() - t0
        c.close()
        flushes = ticks // TICKS_PER_FLUSH
        return {"tick_us": tick_cpu / ticks * 1e6, "flush_ms": flush_cpu / flushes * 1e3}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps-per-tick", type=int, nargs="+", default=[1, 12])
    args = p.parse_args()
    ticks = 400 if args.quick else 2000
    rounds = 3 if args.quick else 6
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"ticks": ticks, "rounds": rounds, "cases": {}}
    for steps in args.steps_per_tick:
        got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(rounds):  # A B A B
            for journal in (False, True):
                got[journal].append(one_round(journal, ticks, steps))
        case: dict[str, Any] = {}
        for journal in (False, True):
            _, tick, _ = quartiles([r["tick_us"] for r in got[journal]])
            _, flush, _ = quartiles([r["flush_ms"] for r in got[journal]])
            case["on" if journal else "off"] = {"tick_us": tick, "flush_ms": flush}
        extra_tick = case["on"]["tick_us"] - case["off"]["tick_us"]
        extra_flush = case["on"]["flush_ms"] - case["off"]["flush_ms"]
        # Per second at a 50 ms tick: 20 ticks and 0.5 flushes.
        share = extra_tick * 1e-6 * (1 / TICK_S) + extra_flush * 1e-3 / (TICKS_PER_FLUSH * TICK_S)
        case["journal_share_of_core"] = share
        figures["cases"][str(steps)] = case
        rows.append({
            "steps/tick": steps,
            "tick off us": case["off"]["tick_us"],
            "tick on us": case["on"]["tick_us"],
            "flush off ms": case["off"]["flush_ms"],
            "flush on ms": case["on"]["flush_ms"],
            "journal, % of a core": 100 * share,
        })  # fmt: skip
    print_table(rows)
    write_json(args.json_path, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
