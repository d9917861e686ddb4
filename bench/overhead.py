"""Collector overhead on the reference workload: trainspec off against fully on, A B A B.

Off: TRAINSPEC_COLLECTOR_ENABLED=0 (plain DDP, no hook, no samplers, no sinks). On: 50 ms
sampling, the latency probe, the run store, a Prometheus endpoint per rank and OTLP export
to a live local endpoint. Reports the median step-time ratio with its spread over
repetitions, the collector's own CPU use as a share of one core, and bytes stored per
rank-hour. Goal: at most 1% step-time overhead.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.jobs import free_port, torchrun  # noqa: E402
from tests.integration.otlp_receiver import OtlpReceiver  # noqa: E402

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402


def one_run(root: Path, tag: str, on: bool, steps: int, ranks: int, otlp_port: int) -> dict:
    timings = root / f"{tag}.json"
    env = {"TRAINSPEC_COLLECTOR_ENABLED": "1" if on else "0"}
    if on:
        env.update(
            TRAINSPEC_COLLECTOR_PROMETHEUS_PORT=str(free_port()),
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
            OTEL_METRIC_EXPORT_INTERVAL="5000",
        )
    torchrun(root, tag, ranks=ranks, env=env, timeout_s=900,
             script_args=[f"--steps={steps}", "--batch-size=16", f"--timings={timings}"])  # fmt: skip
    record = json.loads(timings.read_text())
    times = record["step_times"][steps // 5 :]  # skip warm-up
    stored = sum(p.stat().st_size for p in (root / tag).rglob("*.parquet")) if on else 0
    return {
        "median_step_s": statistics.median(times),
        "wall_s": record["wall_s"],
        "collector_cpu_s": record["collector_cpu_s"],
        "stored_bytes": stored,
    }


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    steps, reps, ranks = (60, 2, 2) if args.quick else (200, 4, 2)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as otlp:
        root = Path(tmp)
        for rep in range(reps):
            for mode in ("off", "on"):  # A B A B: drift on a shared machine hits both alike
                t0 = time.time()
                r = one_run(root, f"{mode}{rep}", mode == "on", steps, ranks, otlp.port)
                results[mode].append(r)
                print(
                    f"  rep {rep} {mode:3s}: median step {r['median_step_s'] * 1e3:7.2f} ms ({time.time() - t0:.0f}s)",
                    flush=True,
                )
        otlp_requests = len(otlp.requests)
    ratios = [
        on["median_step_s"] / off["median_step_s"] for on, off in zip(results["on"], results["off"])
    ]
    q1, med, q3 = quartiles(ratios)
    cpu_share = statistics.median(r["collector_cpu_s"] / r["wall_s"] for r in results["on"])
    bytes_per_rank_hour = statistics.median(
        r["stored_bytes"] / ranks / (r["wall_s"] / 3600.0) for r in results["on"]
    )
    rows = [
        {"mode": m, "median_step_ms": statistics.median(r["median_step_s"] for r in results[m]) * 1e3,
         "runs": len(results[m])}
        for m in ("off", "on")
    ]  # fmt: skip
    print_table(rows)
    print()
    summary = {
        "step_time_ratio_median": med,
        "step_time_ratio_q1": q1,
        "step_time_ratio_q3": q3,
        "ratios": ratios,
        "collector_cpu_share_of_one_core": cpu_share,
        "stored_bytes_per_rank_hour": bytes_per_rank_hour,
        "otlp_requests_received": otlp_requests,
        "steps": steps,
        "reps": reps,
        "ranks": ranks,
    }
    print_table([{"figure": k, "value": v} for k, v in summary.items() if k != "ratios"])
    write_json(args.json_path, {"runs": results, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
