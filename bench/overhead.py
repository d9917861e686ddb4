"""Collector overhead on the reference workload: trainspec off against fully on, A B A B.

Off: TRAINSPEC_COLLECTOR_ENABLED=0 (plain DDP, no hook, no samplers, no sinks, no actuator).
On: 50 ms sampling, the latency probe, the run store, a Prometheus endpoint per rank, OTLP
export to a live local endpoint, and the actuator (which needs the gradient hook, so it is
on whenever the collector is). Reports the median step-time ratio with its spread over
repetitions, the collector's own CPU use as a share of one core, the whole process's extra
CPU per step, and bytes stored per rank-hour. Goal: at most 1% step-time overhead.

`--ablate` runs each configuration in `ABLATIONS` (one part switched off, or only one part
left on) round-robin with `off`, and prints each one's ratio against the off runs on either
side of it, so drift on a shared machine is interpolated away.

Besides the median, each run's p99 step and its stalls (steps over 1.5x the run's median) are
reported: in a synchronous job every step waits for the slowest rank, so one rank's rare
stall becomes the whole job's frequent one as the world grows.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.jobs import free_port, torchrun  # noqa: E402
from tests.integration.otlp_receiver import OtlpReceiver  # noqa: E402

from bench.common import (  # noqa: E402
    add_simulate_device,
    parser,
    print_table,
    quartiles,
    simulate_device_args,
    write_json,
)

OFF = {"TRAINSPEC_COLLECTOR_ENABLED": "0"}
NO_EXPORTERS = {"prometheus": False, "otlp": False}
# name -> (environment on top of "on", which exporters stay on). Each switch is a documented
# configuration key or the actuator's kill switch, so every row is a job a user can run.
ABLATIONS: dict[str, tuple[dict[str, str], dict[str, bool]]] = {
    "on": ({}, {}),
    "on, actuator off": ({"TRAINSPEC_ACTUATOR": "off"}, {}),
    "on, probe off": ({"TRAINSPEC_COLLECTOR_PROBE": "0"}, {}),
    "on, no Prometheus/OTLP": ({}, NO_EXPORTERS),
    "on, 1 s sampling": ({"TRAINSPEC_COLLECTOR_INTERVAL_S": "1.0"}, {}),
    "on, collector threads at nice 10": ({"TRAINSPEC_COLLECTOR_THREAD_NICE": "10"}, {}),
    "on, no gc freeze": ({"TRAINSPEC_COLLECTOR_GC_FREEZE": "0"}, {}),
    "hook + store only": (
        {
            "TRAINSPEC_ACTUATOR": "off",
            "TRAINSPEC_COLLECTOR_PROBE": "0",
            "TRAINSPEC_COLLECTOR_INTERVAL_S": "1.0",
        },
        NO_EXPORTERS,
    ),  # fmt: skip
}


def job_env(name: str, otlp_port: int) -> dict[str, str]:
    if name == "off":
        return dict(OFF)
    extra, exporters = ABLATIONS[name]
    env = {"TRAINSPEC_COLLECTOR_ENABLED": "1", **extra}
    if exporters.get("prometheus", True):
        env["TRAINSPEC_COLLECTOR_PROMETHEUS_PORT"] = str(free_port())
    if exporters.get("otlp", True):
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{otlp_port}"
        env["OTEL_METRIC_EXPORT_INTERVAL"] = "5000"
    return env


def one_run(
    root: Path, tag: str, env: dict[str, str], steps: int, ranks: int, simulate: str | None,
    device: str = "cpu", batch_size: int = 16, model: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    timings = root / f"{tag}.json"
    args = [f"--steps={steps}", f"--batch-size={batch_size}", f"--timings={timings}",
            f"--device={device}", *model]  # fmt: skip
    torchrun(root, tag, ranks=ranks, env=env, timeout_s=900,
             script_args=args + simulate_device_args(simulate))  # fmt: skip
    record = json.loads(timings.read_text())
    times = record["step_times"][steps // 5 :]  # skip warm-up
    median = statistics.median(times)
    return {
        "median_step_s": median,
        "p99_step_s": sorted(times)[int(0.99 * (len(times) - 1))],
        # Steps over 1.5x the run's median: in a job of W ranks a step waits for the slowest,
        # so a rank's rare stall becomes the job's common one as W grows.
        "stalls_per_1000_steps": 1000.0 * sum(t > 1.5 * median for t in times) / len(times),
        "wall_s": record["wall_s"],
        "collector_cpu_s": record["collector_cpu_s"],
        "process_cpu_per_step_s": record["process_cpu_s"] / len(record["step_times"]),
        # The training thread's own CPU: what the hook and the step boundary add, measured
        # apart from the contention that CPU-per-process and wall time also pick up.
        "train_thread_cpu_per_step_s": record["thread_cpu_s"].get("MainThread", float("nan"))
        / len(record["step_times"]),
        "thread_cpu_s": record["thread_cpu_s"],
        "threads": record["threads"],
        "stored_bytes": sum(p.stat().st_size for p in (root / tag).rglob("*.parquet")),
    }


def run_schedule(
    names: list[str], reps: int, run: Callable[[str, str], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """Rounds of off, then each configuration, then one closing off: every configuration's
    run sits between two off runs. Later rounds rotate the order of the configurations."""
    results: dict[str, list[dict[str, Any]]] = {"off": [], **{n: [] for n in names}}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in ["off", *order]:
            results[name].append(run(name, f"r{rep}"))
    results["off"].append(run("off", f"r{reps}"))
    return results


def ratios_against_off(
    results: dict[str, list[dict[str, Any]]], name: str, figure: str = "median_step_s"
) -> list[float]:
    """Per round: the configuration's `figure` over the mean of the bracketing off runs'."""
    off = [r[figure] for r in results["off"]]
    return [r[figure] / ((off[k] + off[k + 1]) / 2) for k, r in enumerate(results[name])]


def check_threads(results: dict[str, list[dict[str, Any]]]) -> None:
    """Off and on must run torch with the same pools, or the ratio measures the settings."""
    pools = {
        (r["threads"]["torch_intra_op"], r["threads"]["torch_inter_op"])
        for runs in results.values()
        for r in runs
    }
    if len(pools) != 1:
        raise SystemExit(f"torch thread pools differ between runs: {sorted(pools)}")


def telemetry_threads_cpu_s(thread_cpu: dict[str, float]) -> float:
    """CPU of the threads trainspec starts or makes start (samplers, probe waiter, flush,
    OTLP reader, Prometheus server), which `Collector.cpu_seconds` only partly sees. The
    gloo threads that carry the probe and the statistics are shared with training and
    show in `extra_cpu_ms_per_step` instead."""
    own = ("trainspec-", "Otel", "Thread-")
    return sum(v for k, v in thread_cpu.items() if k.startswith(own))


def summarise(results: dict[str, list[dict[str, Any]]], ranks: int) -> list[dict[str, Any]]:
    off_cpu = statistics.median(r["process_cpu_per_step_s"] for r in results["off"])
    off_train = statistics.median(r["train_thread_cpu_per_step_s"] for r in results["off"])
    rows = []
    for name, runs in results.items():
        ratios = ratios_against_off(results, name) if name != "off" else [1.0]
        q1, med, q3 = quartiles(ratios)
        p99_ratios = ratios_against_off(results, name, "p99_step_s") if name != "off" else [1.0]
        rows.append({
            "configuration": name,
            "median_step_ms": statistics.median(r["median_step_s"] for r in runs) * 1e3,
            "ratio_vs_off": med,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "p99_ratio_vs_off": statistics.median(p99_ratios),
            "stalls_per_1000": statistics.mean(r["stalls_per_1000_steps"] for r in runs),
            "extra_cpu_ms_per_step": (
                statistics.median(r["process_cpu_per_step_s"] for r in runs) - off_cpu
            ) * 1e3,
            "extra_train_thread_cpu_ms": (
                statistics.median(r["train_thread_cpu_per_step_s"] for r in runs) - off_train
            ) * 1e3,
            "collector_cpu_share": statistics.median(r["collector_cpu_s"] / r["wall_s"] for r in runs),
            "telemetry_threads_cpu_share": statistics.median(
                telemetry_threads_cpu_s(r["thread_cpu_s"]) / r["wall_s"] for r in runs
            ),
            "os_threads": runs[0]["threads"]["os_threads"],
            "runs": len(runs),
        })  # fmt: skip
    return rows


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ablate", action="store_true", help="every configuration in ABLATIONS")
    p.add_argument("--only", default=None,
                   help="with --ablate: these configurations (names from ABLATIONS, '|'-separated)")  # fmt: skip
    p.add_argument("--ranks", type=int, default=2, help="ranks, default 2 (one GPU each on cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo, the default) or cuda (NCCL, rank r on cuda:r)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default by mode)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default by mode)")
    p.add_argument("--layers", type=int, default=None, help="the model's layers (script default 2)")
    p.add_argument("--embd", type=int, default=None, help="its width (script default 128)")
    add_simulate_device(p)
    args = p.parse_args()
    steps, reps = (60, 2) if args.quick else (150, 3) if args.ablate else (200, 4)
    steps, ranks, reps = args.steps or steps, args.ranks, args.rounds or reps
    if ranks < 1 or steps < 5 or args.batch_size < 1 or reps < 1:
        p.error("--ranks, --rounds and --batch-size must be at least 1, --steps at least 5")
    if (args.layers or args.embd) and args.simulate_device_ms:
        p.error("--layers/--embd: the simulated device sets its own small model")
    model = tuple(f"--{name}={value}" for name, value in (("layers", args.layers),
                  ("embd", args.embd)) if value)  # fmt: skip
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < ranks:
            p.error(f"--device cuda: {ranks} ranks need {ranks} GPUs, "
                    f"{torch.cuda.device_count()} visible")  # fmt: skip
    names = list(ABLATIONS) if args.ablate else ["on"]
    if args.only:
        names = [n.strip() for n in args.only.split("|")]
        unknown = [n for n in names if n not in ABLATIONS]
        if unknown:
            p.error(f"--only: no configuration {unknown[0]!r}; they are {list(ABLATIONS)}")
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as otlp:
        root = Path(tmp)
        counter = iter(range(1_000_000))

        def run(name: str, rep: str) -> dict[str, Any]:
            t0 = time.time()
            r = one_run(root, f"run{next(counter)}", job_env(name, otlp.port), steps, ranks,
                        args.simulate_device_ms, args.device, args.batch_size, model)  # fmt: skip
            print(f"  {rep} {name:24s}: median step {r['median_step_s'] * 1e3:7.2f} ms "
                  f"({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
            return r

        results = run_schedule(names, reps, run)
        otlp_requests = len(otlp.requests)
    check_threads(results)
    rows = summarise(results, ranks)
    print_table(rows)
    print()
    on = results["on"]
    ratios = ratios_against_off(results, "on")
    q1, med, q3 = quartiles(ratios)
    summary = {
        "step_time_ratio_median": med,
        "step_time_ratio_q1": q1,
        "step_time_ratio_q3": q3,
        "ratios": ratios,
        "p99_step_ratio_median": statistics.median(ratios_against_off(results, "on", "p99_step_s")),
        "stalls_per_1000_steps_off": statistics.mean(
            r["stalls_per_1000_steps"] for r in results["off"]
        ),
        "stalls_per_1000_steps_on": statistics.mean(r["stalls_per_1000_steps"] for r in on),
        "collector_cpu_share_of_one_core": statistics.median(
            r["collector_cpu_s"] / r["wall_s"] for r in on
        ),
        "telemetry_threads_cpu_share_of_one_core": statistics.median(
            telemetry_threads_cpu_s(r["thread_cpu_s"]) / r["wall_s"] for r in on
        ),
        "stored_bytes_per_rank_hour": statistics.median(
            r["stored_bytes"] / ranks / (r["wall_s"] / 3600.0) for r in on
        ),
        "otlp_requests_received": otlp_requests,
        "torch_threads_per_rank": on[0]["threads"]["torch_intra_op"],
        "steps": steps,
        "reps": reps,
        "ranks": ranks,
        "device": args.device,
        "batch_size": args.batch_size,
        "model_args": list(model),
        "simulate_device_ms": args.simulate_device_ms,
    }
    print_table([{"figure": k, "value": v} for k, v in summary.items() if k != "ratios"])
    write_json(args.json_path, {"runs": results, "table": rows, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
