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

`--replicas K` (K >= 1) replaces the single run per seed with a test per seed: each of ours
and torch's runs from the plain start and from K others (`CONFIG+ulp1+q1` .. `+ulpK+qK`:
every weight one float32 step up or down, and the hook's own random start, its PowerSGD Q,
drawn from seed K; see bench/compression.py), K + 1 final losses per hook per seed, beside one run of `none` (no `none+ulp`). Per seed and pair: the two means, their
difference as mean(ours) / mean(torch) - 1 and its Welch-style standard error (each mean's
sample variance over its count, carried through the ratio to first order). Ours is "worse at
this seed" when the difference exceeds 2 standard errors, "better" below -2, else "tied". That
is a one-seed criterion of about 95% (two-sided; one-sided, about 2.3% of equal-mean seeds
would cross to "worse" under a normal law, 4.6-7% under Student's t with the Welch degrees
of freedom of 4 replicas a side, 3 to 6), not a family-wise one: over ten seeds some crossing
is expected by chance, and the report gives how many (the sum over seeds of that t
probability) and the chance that at least one does. Over the seeds: the mean and median of
the per-seed differences, how many seeds ours is lower, and a paired t statistic of the
per-seed differences (ours' per-seed mean against `none` is reported too). `--quick` with
replicas runs seeds 0-1.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.compression import LOSS_TAIL, NUDGED, run_config, split_start  # noqa: E402

OURS = ["lowrank-bf16:12:3:exact"]  # torch's rank 6 from step 3 spends the same bytes
THEIRS = ["torch:powersgd:6@3"]
CROSSING = 2.0  # standard errors: the per-seed line for "worse" and "better"
WITHIN_NONE = 0.02  # the lowrank goal: final loss within 2% of `none`


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


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` >= 1 degrees of freedom (real df, as Welch's are).
    With x = sqrt(df) tan(theta) the density becomes a smooth c cos(theta)^(df - 1) on
    [0, pi/2), integrated here by Simpson's rule: no scipy needed."""
    if math.isnan(t) or math.isnan(df):
        return float("nan")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if math.isinf(df):
        return 0.5 * math.erfc(t / math.sqrt(2))
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    top = math.atan(abs(t) / math.sqrt(df))
    n = 2000
    h = top / n
    total = sum(
        (1 if i in (0, n) else 4 if i % 2 else 2) * math.cos(i * h) ** (df - 1)
        for i in range(n + 1)
    )
    area = c * total * h / 3  # P(0 < T < |t|)
    return 0.5 - area if t >= 0 else 0.5 + area


def replica_difference(ours: list[float], theirs: list[float]) -> dict:
    """One seed's replicas (final losses of each hook from its plain and nudged starts): the
    means, diff = mean(ours) / mean(theirs) - 1, its standard error (Welch: each mean's
    variance is its sample variance over its count, carried through the ratio to first
    order), the Welch-Satterthwaite degrees of freedom, the verdict ("worse" when diff > 2 SE,
    "better" when diff < -2 SE, "tied" between, "unknown" with fewer than 2 losses a side)
    and `chance`: P(T > 2) at those degrees of freedom, how often an equal-mean seed would
    still be called "worse"."""
    n_o, n_t = len(ours), len(theirs)
    m_o = statistics.fmean(ours) if ours else float("nan")
    m_t = statistics.fmean(theirs) if theirs else float("nan")
    figures = {
        "ours_mean": m_o,
        "theirs_mean": m_t,
        "diff": m_o / m_t - 1,
        "n_ours": n_o,
        "n_theirs": n_t,
    }
    if n_o < 2 or n_t < 2:
        nan = float("nan")
        return {**figures, "se": nan, "t": nan, "df": nan, "chance": nan, "verdict": "unknown"}
    a = statistics.variance(ours) / n_o / m_t**2  # d(m_o / m_t) / d m_o = 1 / m_t
    b = statistics.variance(theirs) / n_t * m_o**2 / m_t**4  # ... / d m_t = -m_o / m_t^2
    se = math.sqrt(a + b)
    if a + b > 0:
        df = (a + b) ** 2 / (a**2 / (n_o - 1) + b**2 / (n_t - 1))
    else:  # no spread on either side: the pooled count
        df = float(n_o + n_t - 2)
    diff = figures["diff"]
    if diff > CROSSING * se:
        verdict = "worse"
    elif diff < -CROSSING * se:
        verdict = "better"
    else:
        verdict = "tied"
    t = diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    return {**figures, "se": se, "t": t, "df": df, "chance": t_sf(CROSSING, df),
            "verdict": verdict}  # fmt: skip


def across_seeds(diffs: list[float]) -> dict:
    """Per-seed mean differences (ours / theirs - 1) summarised over seeds: mean, median, how
    many below 0, and the paired t statistic mean / (sd / sqrt(n)) with n - 1 degrees of
    freedom and its two-sided p."""
    n = len(diffs)
    if n == 0:
        nan = float("nan")
        return {"seeds": 0, "mean": nan, "median": nan, "ours_lower": 0, "paired_t": nan,
                "df": 0, "p_two_sided": nan}  # fmt: skip
    mean = statistics.fmean(diffs)
    t = df = p = float("nan")
    if n >= 2:
        df = n - 1
        sd = statistics.stdev(diffs)
        if sd > 0:
            t = mean / (sd / math.sqrt(n))
        elif mean != 0:  # every seed the same nonzero difference
            t = math.copysign(math.inf, mean)
        p = 2 * t_sf(abs(t), df)
    return {
        "seeds": n,
        "mean": mean,
        "median": statistics.median(diffs),
        "ours_lower": sum(d < 0 for d in diffs),
        "paired_t": t,
        "df": df,
        "p_two_sided": p,
    }


def compare_replicas(
    ours: dict[int, list[float]], theirs: dict[int, list[float]], none: dict[int, float]
) -> dict:
    """A pair over seeds from final losses: seed -> ours' replicas, torch's replicas and the
    one `none` loss. Per seed `replica_difference` and ours' mean against `none`; over the
    seeds `across_seeds` of the differences (seeds with a verdict), the seeds worse, better
    and tied, those without a verdict, the number expected to cross to "worse" by chance
    alone (the sum of each seed's `chance`) and the chance that at least one does."""
    per_seed: dict[int, dict] = {}
    for seed in sorted(set(ours) | set(theirs)):
        figures = replica_difference(ours.get(seed, []), theirs.get(seed, []))
        base = none.get(seed)
        figures["ours_vs_none"] = figures["ours_mean"] / base - 1 if base else float("nan")
        figures["theirs_vs_none"] = figures["theirs_mean"] / base - 1 if base else float("nan")
        per_seed[seed] = figures
    judged = {s: f for s, f in per_seed.items() if f["verdict"] != "unknown"}
    chances = [f["chance"] for f in judged.values()]
    vs_none = [f["ours_vs_none"] for f in per_seed.values() if not math.isnan(f["ours_vs_none"])]
    return {
        "per_seed": per_seed,
        **across_seeds([f["diff"] for f in judged.values()]),
        "worse": sorted(s for s, f in judged.items() if f["verdict"] == "worse"),
        "better": sorted(s for s, f in judged.items() if f["verdict"] == "better"),
        "tied": sorted(s for s, f in judged.items() if f["verdict"] == "tied"),
        "unknown": sorted(s for s, f in per_seed.items() if f["verdict"] == "unknown"),
        "worse_expected_by_chance": sum(chances),
        "any_worse_by_chance": 1 - math.prod(1 - c for c in chances),
        "ours_within_2pct_of_none": sum(v <= WITHIN_NONE for v in vs_none),
        "ours_vs_none_seeds": len(vs_none),
        "ours_vs_none_worst": max(vs_none, default=float("nan")),
    }


def replica_configs(config: str, replicas: int, hook_seed: bool = True) -> list[str]:
    """The plain start and `replicas` others: CONFIG, then CONFIG+ulpK+qK for K = 1 ..
    replicas (the weights nudged and the hook's own random start moved, both from K), or
    CONFIG+ulpK with `hook_seed` False (the weights only: the twelfth series)."""
    suffix = "+ulp{k}+q{k}" if hook_seed else "+ulp{k}"
    return [config, *(config + suffix.format(k=k) for k in range(1, replicas + 1))]


def _starts(replicas: int, vary: str) -> str:
    last = replica_configs("", replicas, vary == "start+q")[-1]
    return f"plain, {replica_configs('', 1, vary == 'start+q')[-1]}..{last}"


def _pct(x: float, sign: bool = True, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def _main_replicas(args, seeds: list[int], ours: list[str], theirs: list[str]) -> int:
    hooks = [*ours, *theirs]
    runs: list[dict] = []
    none: dict[int, float] = {}
    losses: dict[str, dict[int, list[float]]] = {h: {} for h in hooks}
    failed: list[dict] = []
    nbytes: dict[str, float] = {}
    for seed in seeds:
        todo = [("none", "none")]
        for k in range(args.replicas + 1):
            todo += [(h, replica_configs(h, args.replicas, args.vary == "start+q")[k])
                     for h in hooks]  # fmt: skip
        for hook, config in todo:
            r = run_config(config, args.steps, args.batch_size, args.timeout_s, seed)
            r["seed"] = seed
            runs.append(r)
            if "error" in r:
                print(f"  seed {seed} {config}: {r['error']}", flush=True)
                failed.append({"seed": seed, "config": config, "error": r["error"]})
                continue
            print(f"  seed {seed} {config}: loss {r['final_loss']:.4f}", flush=True)
            nbytes.setdefault(hook, r["bytes_per_step"])
            if hook == "none":
                none[seed] = r["final_loss"]
            else:
                losses[hook].setdefault(seed, []).append(r["final_loss"])
    pairs = []
    for o in ours:
        for t in theirs:
            q = compare_replicas(losses[o], losses[t], none)
            pairs.append({"ours": o, "theirs": t, **q})

    print(f"\n2 gloo ranks, {args.steps} steps, batch {args.batch_size}/rank, seeds {seeds}, "
          f"{args.replicas + 1} starts per hook ({_starts(args.replicas, args.vary)})")  # fmt: skip
    for q in pairs:
        print(f"\nours {q['ours']} against torch {q['theirs']}; diff = ours / torch - 1 of the "
              f"per-seed means, worse/better beyond {CROSSING:g} SE:")  # fmt: skip
        print_table([
            {"seed": seed, "none": f"{none[seed]:.4f}" if seed in none else "-",
             "ours mean": f"{f['ours_mean']:.4f}", "torch mean": f"{f['theirs_mean']:.4f}",
             "n": f"{f['n_ours']}/{f['n_theirs']}", "diff": _pct(f["diff"], digits=3),
             "SE": _pct(f["se"], sign=False, digits=3),
             "diff/SE": "-" if math.isnan(f["t"]) else f"{f['t']:+.2f}",
             "verdict": f["verdict"], "ours vs none": _pct(f["ours_vs_none"])}
            for seed, f in q["per_seed"].items()
        ])  # fmt: skip
    print()
    print_table([
        {"ours": q["ours"], "torch": q["theirs"],
         "bytes ours/torch": f"{nbytes.get(q['ours'], math.nan) / nbytes.get(q['theirs'], math.nan):.3f}",
         "ours lower": f"{q['ours_lower']} of {q['seeds']}",
         "mean": _pct(q["mean"]), "median": _pct(q["median"]),
         "paired t": "-" if math.isnan(q["paired_t"]) else f"{q['paired_t']:+.2f} (p {q['p_two_sided']:.2f})",
         "seeds worse": ",".join(map(str, q["worse"])) or "none",
         "seeds better": ",".join(map(str, q["better"])) or "none",
         "worse by chance": f"{q['worse_expected_by_chance']:.2f} (any {q['any_worse_by_chance']:.0%})",
         "ours within 2% of none": f"{q['ours_within_2pct_of_none']} of {q['ours_vs_none_seeds']} "
                                   f"(worst {_pct(q['ours_vs_none_worst'])})",
         "no verdict": ",".join(map(str, q["unknown"])) or "none"}
        for q in pairs
    ])  # fmt: skip
    if failed:
        print(f"\n{len(failed)} run(s) failed: "
              + "; ".join(f"seed {f['seed']} {f['config']}: {f['error']}" for f in failed))  # fmt: skip
    write_json(args.json_path, {
        "steps": args.steps, "batch_per_rank": args.batch_size, "seeds": seeds,
        "replicas": args.replicas, "vary": args.vary, "crossing_se": CROSSING, "bytes_per_step": nbytes,
        "none": none, "losses": losses, "failed": failed, "pairs": pairs,
        "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
    })  # fmt: skip
    return 0


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--seeds", default=None, help="e.g. 0-9 or 0,3,5 (quick: 0-3; 0-1 with replicas)"
    )
    p.add_argument("--steps", type=int, default=120, help="steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per configuration")
    p.add_argument("--ours", default=",".join(OURS), help="our levels, comma-separated")
    p.add_argument("--theirs", default=",".join(THEIRS), help="torch configurations")
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="K",
        help="per seed, each hook also from K other starts (+ulp1+q1..+ulpK+qK) and a 2-SE "
        "test per seed (0: one run per seed and the none+ulp floor)",
    )
    p.add_argument(
        "--vary", choices=("start+q", "start"), default="start+q",
        help="what a replica moves: the weights and the hook's random start (default), or the "
        "weights only (+ulpK, the twelfth series in docs/benchmarks.md)",
    )  # fmt: skip
    args = p.parse_args()
    default_seeds = ("0-1" if args.replicas else "0-3") if args.quick else "0-9"
    try:
        seeds = parse_seeds(args.seeds or default_seeds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.steps <= LOSS_TAIL or args.batch_size < 1 or args.replicas < 0:
        print(
            f"error: need --steps > {LOSS_TAIL}, --batch-size >= 1 and --replicas >= 0",
            file=sys.stderr,
        )
        return 2
    ours = [c.strip() for c in args.ours.split(",") if c.strip()]
    theirs = [c.strip() for c in args.theirs.split(",") if c.strip()]
    try:
        for config in [*ours, *theirs]:
            _, nudge, hook_seed = split_start(config)
            if (nudge is not None or hook_seed) and args.replicas:
                raise ValueError(f"{config!r}: --replicas adds the +ulpK and +qK starts itself")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.replicas:
        return _main_replicas(args, seeds, ours, theirs)
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
