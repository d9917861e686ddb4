"""The latency probe's cost on ranks that fill every core: rounds of compute per second with
no probe, a thread that only wakes every 50 ms, one all-reduce every 50 ms on a side gloo
group of one element (the collector's probe since 2026-11-25) or of 40 (its payload before),
and two (its design before the fifth series of 2026-11-24), alternated A B A B,
with the ranks in lockstep (a 1 M-float all-reduce per round, as DDP's) or computing alone.

It separates the probe's own CPU from what lockstep adds: a delay on one rank is waited
out by every other (docs/collector.md, the fourth series).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.jobs import free_port  # noqa: E402

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402

WORKER = Path(__file__).with_name("probe_worker.py")
MODES = ("none", "wake", "one", "wide", "two")


def one_run(mode: str, lockstep: bool, rounds: int) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(WORKER), f"--mode={mode}",
        f"--rounds={rounds}", *(["--lockstep"] if lockstep else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"probe worker failed ({proc.returncode}): {proc.stderr[-6000:]}")
    return json.loads(lines[-1])


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    reps, rounds = (2, 120) if args.quick else (4, 240)
    results: dict[str, list[dict[str, float]]] = {}
    for lockstep in (True, False):
        for rep in range(reps):
            for mode in MODES:
                r = one_run(mode, lockstep, rounds)
                key = f"{'lockstep' if lockstep else 'alone'} {mode}"
                results.setdefault(key, []).append(r)
                print(f"  r{rep} {key:14s}: {r['rounds_per_s']:6.2f} rounds/s, "
                      f"{r['probes_per_s']:5.1f} probes/s", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for key, runs in results.items():
        base = results[f"{key.split()[0]} none"]
        ratios = [b["rounds_per_s"] / r["rounds_per_s"] for r, b in zip(runs, base)]
        q1, med, q3 = quartiles(ratios)
        rows.append({
            "configuration": key,
            "rounds_per_s": statistics.median(r["rounds_per_s"] for r in runs),
            "probes_per_s": statistics.median(r["probes_per_s"] for r in runs),
            "slowdown_vs_none": med,
            "slowdown_q1": q1,
            "slowdown_q3": q3,
            "process_cpu_share": statistics.median(r["process_cpu_per_s"] for r in runs),
        })  # fmt: skip
    print_table(rows)
    write_json(args.json_path, {"runs": results, "table": rows, "reps": reps,
                                "rounds": rounds})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
