"""Dashboard load time on a run of a million samples: each view's data, as the app loads it.

Builds a synthetic 4-rank run (50 ms samples of three metrics, per-step rows, events) with
SegmentWriter, then times, per view, the same loaders the Streamlit app calls: A = fresh
`store.open` + load (what each 2 s refresh does), B = load on an already open connection,
interleaved A B A B. The compliance verdict (the validator over the whole run) is timed too;
the app caches it per segment change. Goal: every view under 2 s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.dashboard_runs import make_dashboard_run, samples_per_second  # noqa: E402

import trainspec.store as store  # noqa: E402
from bench.common import parser, print_table, quartiles, write_json  # noqa: E402
from trainspec.dashboards.compliance import check_run  # noqa: E402
from trainspec.dashboards.data import (  # noqa: E402
    load_actions,
    load_compare,
    load_hardware,
    load_overview,
)

GOAL_S = 2.0
RANKS = 4


def _views(other: Path) -> dict[str, Callable]:
    def compare(con):
        con_b = store.open(other)
        try:
            return load_compare(con, con_b)
        finally:
            con_b.close()

    return {
        "overview": load_overview,
        "actions": load_actions,
        "hardware": load_hardware,
        "compare": compare,
    }


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=None, help="rows in the samples table")
    args = p.parse_args()
    n_samples = args.samples or (100_000 if args.quick else 1_000_000)
    reps = 3 if args.quick else 5
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        seconds = n_samples / samples_per_second(RANKS)
        t0 = time.perf_counter()
        run = make_dashboard_run(Path(tmp) / "big", ranks=RANKS, seconds=seconds, segments=16)
        other = make_dashboard_run(Path(tmp) / "small", ranks=2, seconds=60.0, seed=5)
        build_s = time.perf_counter() - t0
        rows = store.query(run, "SELECT count(*) AS n FROM samples")["n"][0].as_py()
        steps = store.query(run, "SELECT count(*) AS n FROM steps")["n"][0].as_py()
        views = _views(other)
        cold: dict[str, list[float]] = {v: [] for v in views}
        warm: dict[str, list[float]] = {v: [] for v in views}
        open_con = store.open(run)
        for _ in range(reps):  # A B A B: fresh connection, then the open one, per view
            for name, load in views.items():
                cold[name].append(_time(lambda load=load: load(store.open(run))))
                warm[name].append(_time(lambda load=load: load(open_con)))
        compliance_s = _time(lambda: check_run(run))
    table = []
    for name in views:
        _, med_a, q3_a = quartiles(cold[name])
        _, med_b, _ = quartiles(warm[name])
        table.append(
            {
                "view": name,
                "A open+load s (median)": med_a,
                "A q3 s": q3_a,
                "B load s (median)": med_b,
                "A/B": med_a / med_b if med_b else float("nan"),
                "under 2 s": "yes" if max(cold[name]) < GOAL_S else "NO",
            }
        )
    print(f"run: {rows:,} samples rows, {steps:,} steps rows, {RANKS} ranks "
          f"(built in {build_s:.1f} s); {reps} repetitions")  # fmt: skip
    print_table(table)
    print(
        f"compliance verdict (validator over the whole run, cached by the app): {compliance_s:.2f} s"
    )
    worst = max(max(v) for v in cold.values())
    print(f"slowest view load: {worst:.3f} s (goal < {GOAL_S} s)")
    write_json(
        args.json_path,
        {
            "samples_rows": rows,
            "steps_rows": steps,
            "ranks": RANKS,
            "repetitions": reps,
            "views": table,
            "raw_open_load_s": cold,
            "raw_load_s": warm,
            "compliance_s": compliance_s,
            "slowest_view_s": worst,
            "median_overall_s": statistics.median(x for v in cold.values() for x in v),
        },
    )
    return 0 if worst < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
