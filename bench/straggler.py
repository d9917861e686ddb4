"""Straggler benchmark: one rank slowed 1.5x, 2x, 3x; step time with the actuator off, on, ideal.

Each configuration runs the reference workload under torchrun (gloo, CPU) with the last rank
slowed through TRAINSPEC_INJECT, A B A B: actuator off (kill switch) then on. Steady-state step
time is the median of rank 0's step times over the second half of the run. Ideal is total work
over the sum of rank speeds: the compute part of a step when every rank finishes together,
N / sum_r(1 / t_r) with t_r each rank's measured per-sample compute (from the off run's
store), plus the non-compute part of a healthy step (optimizer, exposed communication) from a
healthy run. Steps to detect and to settle count from the fault's onset (step 0); the table
gives the latest of the repetitions and, per repetition, the steps from the first rebalance to
the last (`settle_after_detect`). A healthy
run with the actuator on must take no action. Goals: on within 5% of ideal, settled within 10
steps of detection, no action when healthy.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.jobs import torchrun  # noqa: E402

import trainspec.store as store  # noqa: E402
from bench.common import (  # noqa: E402
    add_simulate_device,
    parser,
    print_table,
    simulate_device_args,
    write_json,
)

WINDOW = 5
BATCH_PER_RANK = 32  # at 8, one sample is 6% of a 2-rank global batch: coarser than the goal
QUIET = {"TRAINSPEC_ACTUATOR_COMPRESSION": "0", "TRAINSPEC_ACTUATOR_CHECKPOINT": "0"}


def one_run(
    root: Path, tag: str, env: dict[str, str], steps: int, ranks: int, batch_per_rank: int,
    simulate: str | None,
) -> dict:  # fmt: skip
    timings, log = root / f"{tag}-t.json", root / f"{tag}-r{{rank}}.json"
    env = {**QUIET, "TRAINSPEC_ACTUATOR_WINDOW_STEPS": str(WINDOW), **env}
    args = [f"--steps={steps}", f"--batch-size={batch_per_rank}", "--max-bytes=400000",
            f"--timings={timings}", f"--actuator-log={log}"]  # fmt: skip
    args += simulate_device_args(simulate)
    torchrun(root, tag, ranks=ranks, env=env, script_args=args, timeout_s=600)
    times = json.loads(timings.read_text())["step_times"]
    rank0 = json.loads(Path(str(log).replace("{rank}", "0")).read_text())
    steady = times[steps // 2 :]
    per_rank = (
        store.open(root / tag)
        .execute(
            "select rank, sum(forward_s + backward_s - coalesce(comm_exposed_s, 0)) / sum(samples), "
            "median(duration_s - forward_s - backward_s + coalesce(comm_exposed_s, 0)) "
            f"from steps where step >= {steps // 2} group by rank order by rank"
        )
        .fetchall()
    )
    history = [h for h in rank0["history"] if h.get("applied") or h["kind"] == "rebalance"]
    rebalances = [h["step"] for h in history if h["kind"] == "rebalance"]
    return {
        "median_step_s": statistics.median(steady),
        "per_sample_compute_s": [r[1] for r in per_rank],
        "non_compute_s": statistics.median(r[2] for r in per_rank),
        "actions": len([h for h in rank0["history"] if h["kind"] != "stopped"]),
        "detect_step": rebalances[0] if rebalances else None,
        "settle_step": rebalances[-1] if rebalances else None,
        "final_shares": rank0["shares"][-1],
        "control_cost_per_step_s": (rank0["cost"] or {}).get("per_step_s"),
    }


def best_split_step_s(off: dict, on: dict, healthy: dict, global_batch: int) -> float:
    """A second reference beside the ideal: the best integer split under each rank's measured
    line c_r(n) = a_r + b_r n (through its equal-share point in `off` and its final-share point
    in `on`), plus the healthy non-compute part. The ideal has no fixed per-step cost; an
    injected slowdown (and a slower GPU) scales a rank's fixed cost too, which no split removes.
    Greedy: each sample goes to the rank that would finish it first (optimal for a makespan of
    increasing lines)."""
    ranks = len(off["per_sample_compute_s"])
    equal = global_batch // ranks
    lines = []
    for r in range(ranks):
        c_eq = off["per_sample_compute_s"][r] * equal
        n_on = on["final_shares"][r]
        c_on = on["per_sample_compute_s"][r] * n_on
        slope = (c_on - c_eq) / (n_on - equal) if n_on != equal else c_eq / equal
        slope = slope if slope > 0 else c_eq / equal
        lines.append((max(0.0, c_eq - slope * equal), slope))
    shares = [1] * ranks
    for _ in range(global_batch - ranks):
        r = min(range(ranks), key=lambda i: lines[i][0] + lines[i][1] * (shares[i] + 1))
        shares[r] += 1
    compute = max(a + b * n for (a, b), n in zip(lines, shares))
    return compute + healthy["non_compute_s"]


def ideal_step_s(slow_run: dict, healthy: dict, global_batch: int) -> float:
    speeds = sum(1.0 / t for t in slow_run["per_sample_compute_s"])
    return global_batch / speeds + healthy["non_compute_s"]


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch-per-rank", type=int, default=BATCH_PER_RANK, help="equal share")
    add_simulate_device(p)
    args = p.parse_args()
    if args.ranks < 2 or args.batch_per_rank < 1:
        p.error("need --ranks >= 2 and --batch-per-rank >= 1")
    steps, reps = (60, 1) if args.quick else (100, 2)
    factors = (1.5, 2.0, 3.0)
    ranks, global_batch = args.ranks, args.batch_per_rank * args.ranks
    inject = {"TRAINSPEC_ALLOW_INJECT": "1"}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan = [("healthy", {}, "on")]
        for f in factors:
            slow = {**inject, "TRAINSPEC_INJECT": f"slow:rank={ranks - 1},factor={f}"}
            plan += [(f"x{f}", {**slow, "TRAINSPEC_ACTUATOR": "off"}, "off"), (f"x{f}", slow, "on")]
        for rep in range(reps):
            for name, env, mode in plan:  # A B A B: drift on a shared machine hits both alike
                t0 = time.time()
                r = one_run(root, f"{name}-{mode}-{rep}", env, steps, ranks, args.batch_per_rank,
                           args.simulate_device_ms)  # fmt: skip
                runs.setdefault(f"{name}/{mode}", []).append(r)
                print(f"  rep {rep} {name:7s} {mode:3s}: median step {r['median_step_s'] * 1e3:7.2f} ms"
                      f" actions {r['actions']} ({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    healthy = runs["healthy/on"][0]
    rows = []
    for f in factors:
        off, on = runs[f"x{f}/off"], runs[f"x{f}/on"]
        off_s = statistics.median(r["median_step_s"] for r in off)
        on_s = statistics.median(r["median_step_s"] for r in on)
        ideal = statistics.median(ideal_step_s(r, healthy, global_batch) for r in off)
        best = statistics.median(
            best_split_step_s(a, b, healthy, global_batch) for a, b in zip(off, on)
        )
        slowdown = [max(r["per_sample_compute_s"]) / min(r["per_sample_compute_s"]) for r in off]
        detect = [r["detect_step"] for r in on]
        settle = [r["settle_step"] for r in on]
        # per repetition: steps from the first rebalance to the last (0: one move settled it)
        after = [s - d for d, s in zip(detect, settle) if d is not None and s is not None]
        rows.append({
            "ranks": ranks, "factor": f, "measured_slowdown": statistics.median(slowdown),
            "off_ms": off_s * 1e3, "on_ms": on_s * 1e3, "ideal_ms": ideal * 1e3,
            "on_over_ideal": on_s / ideal, "off_over_ideal": off_s / ideal,
            "best_split_ms": best * 1e3, "on_over_best_split": on_s / best,
            "detect_step": max((d for d in detect if d is not None), default=None),
            "settle_step": max((s for s in settle if s is not None), default=None),
            "settle_after_detect": after,
            "final_shares": on[-1]["final_shares"],
        })  # fmt: skip
    print_table(rows)
    healthy_actions = [r["actions"] for r in runs["healthy/on"]]
    cost = statistics.median(
        r["control_cost_per_step_s"] for k, v in runs.items() if k.endswith("/on") for r in v
    )
    summary = {
        "healthy_actions": healthy_actions,
        "control_cost_per_step_ms": cost * 1e3,
        "healthy_median_step_ms": healthy["median_step_s"] * 1e3,
        "steps": steps,
        "reps": reps,
        "window_steps": WINDOW,
        "batch_per_rank": args.batch_per_rank,
        "simulate_device_ms": args.simulate_device_ms,
    }
    print()
    print_table([{"figure": k, "value": v} for k, v in summary.items()])
    write_json(args.json_path, {"rows": rows, "runs": runs, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
