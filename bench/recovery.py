"""Recovery benchmark: kill a rank of the two-rank reference job, time the way back; async stall.

Recovery: SIGKILL one rank (TRAINSPEC_INJECT) of a TinyGPT job under `torchrun --max-restarts=1`
and split the time from the kill to the first completed step after resume into detection
(torchrun reports the failed worker), restart (until the new process runs Python), import,
init+load (process group, checkpoint), first step; catch-up is until the killed step is done
again. Steps recomputed and samples lost or duplicated (against an uninterrupted run) are
counted. Save cost: the training loop's stall per checkpoint with async and sync saves, runs
alternated A B A B in one invocation (7 measured saves per run: the first pays one-offs).

    python bench/recovery.py [--quick] [--save-only] [--pairs N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"))
from recovery_logs import (  # noqa: E402
    child_env,
    committed_steps,
    read_attempts,
    recomputed_steps,
    run_job,
    sample_multiset,
    torchrun_command,
)

MODEL = ("--n-embd", "128", "--n-layer", "2")
CKPT_EVERY = 5


def run_with_timestamps(
    cmd: list[str], env: dict[str, str], timeout_s: float
) -> tuple[int, list[tuple[float, str]]]:
    """Run `cmd`, stamping each output line with its arrival time."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    reader.join(timeout=5)
    return code, lines


def measure_recovery(
    work: Path, steps: int, reference_samples: Counter, kill_step: int, kill_rank: int
) -> dict:
    out, ckpt = work / "out", work / "ckpt"
    env = child_env(
        {
            "TRAINSPEC_INJECT": f"kill:rank={kill_rank},step={kill_step}",
            "TRAINSPEC_ALLOW_INJECT": "1",
        }
    )
    cmd = torchrun_command(
        out, ckpt, "--steps", str(steps), "--ckpt-every", "5", *MODEL, max_restarts=1
    )
    code, lines = run_with_timestamps(cmd, env, timeout_s=300)
    if code != 0:
        raise RuntimeError("recovery run failed:\n" + "\n".join(line for _, line in lines[-40:]))
    attempts = read_attempts(out)
    first, second = attempts[0], attempts[1]
    ranks = sorted(second.records)
    t_kill = first.first("kill", kill_rank)["t"]
    t_detect = next(t for t, line in lines if "failed (exitcode" in line and t >= t_kill - 1)
    t_started = max(second.first("start", r)["started"] for r in ranks)
    t_imported = max(second.first("start", r)["t"] for r in ranks)
    t_loaded = max(second.first("resume", r)["t"] for r in ranks)
    t_first = max(second.steps(r)[0]["t"] for r in ranks)
    t_caught = max(next(s["t"] for s in second.steps(r) if s["step"] == kill_step) for r in ranks)
    got = sample_multiset(committed_steps(attempts))
    return {
        "kill_rank": kill_rank,
        "kill_step": kill_step,
        "resumed_from": second.resume_step,
        "detection_s": t_detect - t_kill,
        "restart_s": t_started - t_detect,
        "import_s": t_imported - t_started,
        "init_load_s": t_loaded - t_imported,
        "first_step_s": t_first - t_loaded,
        "kill_to_first_step_s": t_first - t_kill,
        "catch_up_s": t_caught - t_loaded,
        "kill_to_caught_up_s": t_caught - t_kill,
        "steps_recomputed": recomputed_steps(attempts),
        "samples_lost": sum((reference_samples - got).values()),
        "samples_duplicated": sum((got - reference_samples).values()),
    }


def measure_save_stalls(work: Path, mode: str, steps: int) -> tuple[list[dict], list[float]]:
    """Rank 0's save records, and its step intervals that contain no save call: in async runs
    those overlap the background half of saves, so async against sync shows what it costs."""
    extra = ("--sync-save",) if mode == "sync" else ()
    proc = run_job(
        work / "out",
        work / "ckpt",
        "--steps",
        str(steps),
        "--ckpt-every",
        str(CKPT_EVERY),
        *MODEL,
        *extra,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} save run failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(x) for x in (work / "out" / "events_r0_a0.jsonl").read_text().splitlines()]
    saves = [
        e["evidence"] for e in events if e["kind"] == "checkpoint" and e["reason"] == "periodic"
    ]
    logged = [json.loads(x) for x in (work / "out" / "steps_r0_a0.jsonl").read_text().splitlines()]
    times = {r["step"]: r["t"] for r in logged if r["kind"] == "step"}
    intervals = [
        times[s] - times[s - 1]
        for s in sorted(times)
        if s - 1 in times and (s - 1) % CKPT_EVERY != 0 and s > CKPT_EVERY  # not step 1's warm-up
    ]
    return saves[1:], intervals  # the first save pays one-off costs (thread and stager start-up)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one recovery and one A B pair")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--save-only", action="store_true", help="only the save-cost A B runs")
    parser.add_argument("--pairs", type=int, default=None, help="A B pairs of save runs")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    steps = 24 if args.quick else 40
    repeats = 0 if args.save_only else 1 if args.quick else 3
    pairs = args.pairs if args.pairs is not None else 1 if args.quick else 2
    if pairs < 1:
        parser.error(f"--pairs must be at least 1, got {pairs}")

    with tempfile.TemporaryDirectory(prefix="trainspec-bench-recovery-") as tmp:
        root = Path(tmp)
        recoveries = _measure_recoveries(root, steps, repeats, random.Random(seed))
        stalls: dict[str, list[dict]] = {"async": [], "sync": []}
        steps_s: dict[str, list[float]] = {"async": [], "sync": []}
        for i in range(pairs):  # A B A B: load drifts on a shared machine; alternate to share it
            for mode in ("async", "sync"):
                saves, intervals = measure_save_stalls(root / f"{mode}{i}", mode, 40)
                stalls[mode] += saves
                steps_s[mode] += intervals

    summary = _summarise(recoveries, stalls, steps_s)
    _print_table(recoveries, summary)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "seed": seed,
                    "recoveries": recoveries,
                    "saves": stalls,
                    "steps_s": steps_s,
                    "summary": summary,
                },
                indent=1,
            )
        )
    return 0


def _measure_recoveries(root: Path, steps: int, repeats: int, rng: random.Random) -> list[dict]:
    if repeats == 0:
        return []
    ref = run_job(
        root / "ref" / "out",
        root / "ref" / "ckpt",
        "--steps",
        str(steps),
        "--ckpt-every",
        "5",
        *MODEL,
    )
    if ref.returncode != 0:
        raise RuntimeError(f"reference run failed: {ref.stderr[-2000:]}")
    reference_samples = sample_multiset(committed_steps(read_attempts(root / "ref" / "out")))
    return [
        measure_recovery(
            root / f"kill{i}",
            steps,
            reference_samples,
            rng.randrange(8, steps - 2),
            rng.randrange(2),
        )
        for i in range(repeats)
    ]


def _summarise(
    recoveries: list[dict], stalls: dict[str, list[dict]], steps_s: dict[str, list[float]]
) -> dict:
    def median(rows: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    async_stall = statistics.median(s["stall_s"] for s in stalls["async"])
    sync_stall = statistics.median(s["stall_s"] for s in stalls["sync"])
    return {
        "kill_to_first_step_s_median": median(recoveries, "kill_to_first_step_s"),
        "kill_to_caught_up_s_median": median(recoveries, "kill_to_caught_up_s"),
        "samples_lost": sum(r["samples_lost"] for r in recoveries),
        "samples_duplicated": sum(r["samples_duplicated"] for r in recoveries),
        "async_stall_s_median": async_stall,
        "async_stall_s_p90": statistics.quantiles([s["stall_s"] for s in stalls["async"]], n=10)[-1]
        if len(stalls["async"]) > 1
        else async_stall,
        "async_stage_s_median": median(stalls["async"], "stage_s"),
        "async_wait_s_median": median(stalls["async"], "wait_s"),
        "sync_stall_s_median": sync_stall,
        "async_over_sync_stall": async_stall / sync_stall,
        "async_save_duration_s_median": statistics.median(s["duration_s"] for s in stalls["async"]),
        "checkpoint_bytes": stalls["async"][0]["bytes"],
        "step_s_median": {k: statistics.median(v) for k, v in steps_s.items()},
        "save_samples": {k: len(v) for k, v in stalls.items()},
    }


def _print_table(recoveries: list[dict], summary: dict) -> None:
    cols = [
        "detection_s",
        "restart_s",
        "import_s",
        "init_load_s",
        "first_step_s",
        "kill_to_first_step_s",
        "catch_up_s",
        "kill_to_caught_up_s",
    ]
    if recoveries:
        print(
            f"{'kill':>9} {'resume':>6} "
            + " ".join(f"{c.removesuffix('_s'):>14}" for c in cols)
            + "  recomp lost dup"
        )
    for r in recoveries:
        kill = f"r{r['kill_rank']}@{r['kill_step']}"
        print(
            f"{kill:>9} {r['resumed_from']:>6} "
            + " ".join(f"{r[c]:>14.3f}" for c in cols)
            + f"  {r['steps_recomputed']:>6} {r['samples_lost']:>4} {r['samples_duplicated']:>3}"
        )
    if recoveries:
        print()
    print(f"{'save':<6} {'median stall s':>15} {'of which staging':>17} {'p90 stall s':>12}")
    print(
        f"{'async':<6} {summary['async_stall_s_median']:>15.4f} "
        f"{summary['async_stage_s_median']:>17.4f} {summary['async_stall_s_p90']:>12.4f}"
    )
    print(f"{'sync':<6} {summary['sync_stall_s_median']:>15.4f}")
    step = summary["step_s_median"]
    print(
        f"steps without a save call, median: {step['async'] * 1e3:.1f} ms in async runs "
        f"(overlapping background saves), {step['sync'] * 1e3:.1f} ms in sync runs"
    )
    print(
        f"async stall / sync stall = {summary['async_over_sync_stall']:.3f}  "
        f"(checkpoint {summary['checkpoint_bytes'] / 1e6:.1f} MB, saves {summary['save_samples']})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
