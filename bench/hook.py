"""The gradient hook's cost on the reference model: DDP's built-in all-reduce, torch's Python
`allreduce_hook`, and trainspec's hook at level `none` (statistics carried in the last
bucket's all-reduce, and, for comparison, in an all-reduce of their own), in one two-rank
gloo job, alternated A B A B.

Reports per hook the median and p99 step, stalls (steps over 1.5x the round's median) per
1000 steps, and the training thread's and whole process's CPU per step, each against the
built-in. In a synchronous job every step waits for the slowest rank, so a rank's rare
stall becomes the job's frequent one as the world grows: the tail is reported beside the
median (docs/collector.md).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.jobs import free_port  # noqa: E402

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402

WORKER = Path(__file__).with_name("hook_worker.py")
STALL = 1.5  # a step over this many times its round's median


def run_job(steps: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(WORKER), f"--steps={steps}",
        f"--rounds={rounds}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"hook worker failed ({proc.returncode}): {proc.stderr[-6000:]}")
    return json.loads(lines[-1])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    def median_step(r: dict[str, Any]) -> float:
        return statistics.median(r["step_times"])

    def p99(r: dict[str, Any]) -> float:
        times = sorted(r["step_times"])
        return times[int(0.99 * (len(times) - 1))]

    base = runs["builtin"]
    rows = []
    for hook, rounds in runs.items():
        ratios = [median_step(r) / median_step(b) for r, b in zip(rounds, base, strict=True)]
        q1, med, q3 = quartiles(ratios)
        stalls = [sum(t > STALL * median_step(r) for t in r["step_times"]) for r in rounds]
        steps = sum(len(r["step_times"]) for r in rounds)
        rows.append({
            "hook": hook,
            "median_step_ms": statistics.median(median_step(r) for r in rounds) * 1e3,
            "ratio_vs_builtin": med,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "p99_step_ms": statistics.median(p99(r) for r in rounds) * 1e3,
            "p99_ratio_vs_builtin": statistics.median(
                p99(r) / p99(b) for r, b in zip(rounds, base, strict=True)
            ),
            "stalls_per_1000": 1000.0 * sum(stalls) / steps,
            "extra_thread_cpu_ms": statistics.median(
                r["thread_cpu_per_step_s"] - b["thread_cpu_per_step_s"]
                for r, b in zip(rounds, base, strict=True)
            ) * 1e3,
            "extra_process_cpu_ms": statistics.median(
                r["process_cpu_per_step_s"] - b["process_cpu_per_step_s"]
                for r, b in zip(rounds, base, strict=True)
            ) * 1e3,
        })  # fmt: skip
    return rows


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    steps, rounds = (100, 2) if args.quick else (400, 4)
    runs = run_job(steps, rounds)
    rows = summarise(runs)
    print_table(rows)
    write_json(args.json_path, {"runs": runs, "table": rows, "steps": steps, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
