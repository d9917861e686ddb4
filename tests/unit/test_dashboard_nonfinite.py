"""NaN and inf in a run: every loader aggregates the finite values only, NULL stays NULL.

One NaN or +inf in a bucket made DuckDB's avg NaN (or inf), which blanked the chart, and the
phases bar showed a whole phase as 0.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import trainspec.store as store
from tests.helpers.dashboard_runs import append_samples, append_steps, make_dashboard_run
from trainspec.dashboards.data import (
    MEMORY_METRIC,
    load_actions,
    load_compare,
    load_hardware,
    load_overview,
)

RANKS = 2
STEPS = 20  # make_dashboard_run's steps for 5 s
NAN_STEPS = {"duration_s": math.nan, "forward_s": math.inf, "loss": math.nan,
             "grad_variance": math.inf, "comm_exposed_s": math.nan}  # fmt: skip
INF_STEPS = {"duration_s": math.inf, "data_wait_s": -math.inf, "grad_noise_scale": math.nan}
BAD_SAMPLES = [math.nan, math.inf, -math.inf]


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    """Steps 0-19 finite; 20-21 and 22-23 hold NaN and inf; bad samples 1 s in."""
    run = make_dashboard_run(
        tmp_path_factory.mktemp("nan") / "run-nan", ranks=RANKS, seconds=5.0, gpus=True
    )
    append_steps(run, ranks=RANKS, first_step=STEPS, count=2, values=NAN_STEPS)
    append_steps(run, ranks=RANKS, first_step=STEPS + 2, count=2, values=INF_STEPS)
    for metric, attrs in ((MEMORY_METRIC, "{}"), ("trainspec.gpu.power", '{"gpu.index": 0}')):
        append_samples(run, rank=0, metric=metric, values=BAD_SAMPLES, at_s=1.0, attrs=attrs)
    return run


def _all_finite(frame: pd.DataFrame, columns: list[str]) -> None:
    """Every value present and finite: the chart shows every bucket."""
    values = frame[columns].to_numpy(dtype=float)
    assert len(frame) and np.isfinite(values).all(), frame[columns].describe()


def test_every_overview_frame_is_finite_where_a_bucket_has_a_finite_value(bad_run):
    # points=4: 24 steps in buckets of 6, the last mixing finite steps 18-19 with bad 20-23
    data = load_overview(store.open(bad_run), points=4)
    _all_finite(data.step_time, ["duration_s", "compute_s", "comm_exposed_s", "data_wait_s"])
    _all_finite(data.phases, ["seconds"])
    _all_finite(data.gradients, ["grad_variance", "grad_noise_scale", "grad_norm", "loss"])
    nan_steps = data.heatmap["step"].isin([STEPS, STEPS + 1])  # 120 bins: a step per bin
    _all_finite(data.heatmap[~nan_steps], ["compute_s"])
    assert data.heatmap[nan_steps]["compute_s"].isna().all()
    _all_finite(data.stragglers, ["compute_s", "ratio"])
    _all_finite(data.series, ["value", "peak"])
    assert data.summary.steps == STEPS + 4 and math.isfinite(data.summary.span_s)


def test_phases_are_the_mean_of_the_finite_values(bad_run):
    data = load_overview(store.open(bad_run))
    forward = data.phases[data.phases["phase"] == "forward"].set_index("rank")["seconds"]
    finite = store.query(
        bad_run,
        f"SELECT rank, avg(forward_s) AS f FROM steps WHERE step NOT IN ({STEPS}, {STEPS + 1}) "
        "GROUP BY rank",
    )
    for rank, mean in zip(finite["rank"].to_pylist(), finite["f"].to_pylist()):
        assert forward[rank] == pytest.approx(mean) and mean > 0


def test_a_bucket_without_a_finite_value_is_null_not_zero(bad_run):
    data = load_overview(store.open(bad_run))  # one step per bucket
    duration = data.step_time.set_index(["rank", "step"])["duration_s"]
    assert duration.loc[(0, STEPS)] != duration.loc[(0, STEPS)]  # NaN from NULL, not 0
    assert np.isfinite(duration.loc[(0, STEPS - 1)])
    loss = data.gradients.set_index("step")["loss"]
    assert pd.isna(loss[STEPS]) and np.isfinite(loss[STEPS + 2])


def test_actions_hardware_and_compare_skip_the_bad_values(bad_run):
    con = store.open(bad_run)
    _all_finite(load_actions(con, points=4).timeline, ["duration_s"])
    hw = load_hardware(con, points=4).series
    _all_finite(hw[hw["metric"] == "trainspec.gpu.power"], ["value", "peak"])
    stats = load_compare(con, store.open(bad_run), points=4)
    _all_finite(stats.stats, ["a", "b", "ratio"])
    _all_finite(stats.curves, ["duration_s", "throughput"])


def test_the_summary_counts_the_values_it_left_out(bad_run, tmp_path):
    summary = load_overview(store.open(bad_run)).summary
    per_step = len(NAN_STEPS) + len(INF_STEPS)
    assert summary.nonfinite == RANKS * 2 * per_step + 2 * len(BAD_SAMPLES)
    clean = make_dashboard_run(tmp_path / "clean", ranks=1, seconds=1.0)
    assert load_overview(store.open(clean)).summary.nonfinite == 0


def test_the_report_names_the_count(bad_run, tmp_path):
    from trainspec.dashboards.report import render_report

    (out,) = render_report(bad_run, html=tmp_path / "r.html")
    text = out.read_text()
    summary = load_overview(store.open(bad_run)).summary
    assert "NaN or infinite values" in text and f"<td>{summary.nonfinite}</td>" in text
