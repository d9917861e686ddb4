"""Our lowrank level against torch's PowerSGD over many seeds, with the noise floor measured.

One run per seed cannot say "never worse": moving every starting weight by one float32 step
(`none+ulp`, see bench/compression.py) already moves the final loss at 120 steps by up to a
few percent, so a single seed's difference between two hooks is mostly where chaos took each
trajectory. This runs every configuration on each seed (A B C per seed, fresh processes, the
same shim counting bytes for every hook) and reports, per pair (ours, torch's):

- per seed, ours / torch's - 1 of the final loss (mean global loss of the last steps);
- how often ours ended lower, the mean and median difference over seeds;
- the noise floor: |none+ulp / none - 1| per seed (its largest value is the bar);
- the seeds where ours was worse by more than that bar, or where our run failed: the ones
  that count as a loss (a seed where only torch's run failed is left out, and counted).

The bar is the largest of N one-step perturbations, so it grows with the number of seeds;
it measures how far chaos alone carries `none` in this many steps, not a confidence bound.

`python bench/compression_seeds.py --quick` (4 seeds, 120 steps); the defaults (10 seeds,
120 steps) are what docs/benchmarks.md records.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.compression import LOSS_TAIL, NUDGED, run_config  # noqa: E402

OURS = ["lowrank-bf16:12:3:exact"]  # torch's rank 6 from step 3 spends the same bytes
THEIRS = ["torch:powersgd:6@3"]


def parse_seeds(spec: str) -> list[int]:
    """'0-9' or '0,2,5' (or a mix) to a sorted list of distinct seeds."""
    seeds: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"bad seed range {part!r}: want N, N-M or a comma list") from None
        if last < first or first < 0:
            raise ValueError(f"bad seed range {part!r}: want 0 <= N <= M")
        seeds.update(range(first, last + 1))
    if not seeds:
        raise ValueError("no seeds given")
    return sorted(seeds)


def compare(
    finals: dict[int, dict[str, float]],
    failed: dict[int, set[str]],
    ours: str,
    theirs: str,
    bar: float,
) -> dict:
    """The pair's per-seed differences and their summary; `bar` is the noise floor (nan when
    it could not be measured). A seed where our run failed counts against ours; one where
    only torch's failed is left out, and both are listed."""
    diffs = {
        seed: by[ours] / by[theirs] - 1
        for seed, by in finals.items()
        if ours in by and theirs in by
    }
    ours_failed = sorted(s for s, names in failed.items() if ours in names)
    theirs_failed = sorted(
        s for s, names in failed.items() if theirs in names and ours not in names
    )
    values = list(diffs.values())
    worse = None if math.isnan(bar) else sorted(s for s, d in diffs.items() if d > bar)
    return {
        "ours": ours,
        "theirs": theirs,
        "per_seed": diffs,
        "seeds": len(values) + len(ours_failed),
        "ours_lower": sum(d < 0 for d in values),
        "mean": statistics.fmean(values) if values else float("nan"),
        "median": statistics.median(values) if values else float("nan"),
        "worse_beyond_floor": None if worse is None else sorted(worse + ours_failed),
        "ours_failed": ours_failed,
        "theirs_failed": theirs_failed,
    }


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", default=None, help="e.g. 0-9 or 0,3,5 (quick: 0-3)")
    p.add_argument("--steps", type=int, default=120, help="steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per configuration")
    p.add_argument("--ours", default=",".join(OURS), help="our levels, comma-separated")
    p.add_argument("--theirs", default=",".join(THEIRS), help="torch configurations")
    args = p.parse_args()
    try:
        seeds = parse_seeds(args.seeds or ("0-3" if args.quick else "0-9"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.steps <= LOSS_TAIL or args.batch_size < 1:
        print(f"error: need --steps > {LOSS_TAIL} and --batch-size >= 1", file=sys.stderr)
        return 2
    ours = [c.strip() for c in args.ours.split(",") if c.strip()]
    theirs = [c.strip() for c in args.theirs.split(",") if c.strip()]
    configs = ["none", NUDGED, *ours, *theirs]
    runs: list[dict] = []
    finals: dict[int, dict[str, float]] = {}
    failed: dict[int, set[str]] = {}
    nbytes: dict[str, float] = {}
    for seed in seeds:
        for config in configs:
            r = run_config(config, args.steps, args.batch_size, args.timeout_s, seed)
            r["seed"] = seed
            runs.append(r)
            if "error" in r:
                print(f"  seed {seed} {config}: {r['error']}", flush=True)
                failed.setdefault(seed, set()).add(config)
                continue
            finals.setdefault(seed, {})[config] = r["final_loss"]
            nbytes[config] = r["bytes_per_step"]
            print(f"  seed {seed} {config}: loss {r['final_loss']:.4f}", flush=True)
    floor = {
        seed: abs(by[NUDGED] / by["none"] - 1)
        for seed, by in finals.items()
        if NUDGED in by and "none" in by
    }
    bar = max(floor.values(), default=float("nan"))  # nan: no seed gave both runs
    pairs = [compare(finals, failed, o, t, bar) for o in ours for t in theirs]

    print(f"\n2 gloo ranks, {args.steps} steps, batch {args.batch_size}/rank, seeds {seeds}")
    print("final loss per seed:")
    print_table([
        {"seed": seed, **{c: f"{by[c]:.4f}" if c in by else "-" for c in configs},
         "floor": f"{100 * floor[seed]:.2f}%" if seed in floor else "-"}
        for seed, by in sorted(finals.items())
    ])  # fmt: skip
    if floor:
        print(f"\nnoise floor (|none+ulp / none - 1|) over {len(floor)} seeds: largest "
              f"{100 * bar:.2f}%, median {100 * statistics.median(floor.values()):.2f}%")  # fmt: skip
    else:
        print("\nno noise floor: none or none+ulp failed on every seed")
    print_table([
        {"ours": q["ours"], "torch": q["theirs"],
         "bytes ours/torch": f"{nbytes.get(q['ours'], float('nan')) / nbytes.get(q['theirs'], float('nan')):.3f}",
         "ours lower": f"{q['ours_lower']} of {q['seeds']}",
         "mean": f"{100 * q['mean']:+.2f}%", "median": f"{100 * q['median']:+.2f}%",
         "seeds worse beyond floor": "unknown" if q["worse_beyond_floor"] is None
         else ",".join(map(str, q["worse_beyond_floor"])) or "none",
         "failed (ours / torch)": f"{len(q['ours_failed'])} / {len(q['theirs_failed'])}"}
        for q in pairs
    ])  # fmt: skip
    write_json(args.json_path, {
        "steps": args.steps, "batch_per_rank": args.batch_size, "seeds": seeds,
        "bytes_per_step": nbytes, "noise_floor": floor,
        "noise_bar": None if math.isnan(bar) else bar,
        "pairs": pairs, "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
