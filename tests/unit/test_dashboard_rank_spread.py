"""Per-rank charts of a 1,024-rank run: the spread across ranks and the slowest ranks.

A line per rank sent 1,024 lines and a 1,024-entry legend to the browser (40,960 rows for
step time alone, past Altair's 5,000-row limit), the report's phases and series figures
took 2-3 s to draw 6,144 bars and 3,072 lines, and the stragglers table listed every rank
in rank order. Beyond LINE_RANKS ranks the loaders now return O(buckets) rows.
"""

from __future__ import annotations

import re

import pandas as pd
import pytest

import trainspec.store as store
from tests.helpers.dashboard_runs import make_wide_run
from trainspec.dashboards import charts, figures
from trainspec.dashboards.data import LINE_RANKS, load_overview
from trainspec.dashboards.phases import PHASES
from trainspec.dashboards.report import render_report
from trainspec.dashboards.stragglers import SLOWEST_RANKS, STRAGGLER_ROWS, straggler_table

STRAGGLER = 700
SECONDS = 10.0  # 40 steps, 200 time buckets of 50 ms
STEPS = 40
TIME_BUCKETS = 200
METRICS = 3


def _wide(path, ranks: int):
    run = make_wide_run(path, ranks=ranks, seconds=SECONDS, straggler=STRAGGLER % ranks)
    return load_overview(store.open(run))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return _wide(tmp_path_factory.mktemp("wide") / "run-1024", 1024)


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory):
    return _wide(tmp_path_factory.mktemp("sixteen") / "run-16", 16)


def _sizes(data) -> dict[str, int]:
    frames = ("step_time", "step_spread", "phases", "series", "series_spread")
    return {name: len(getattr(data, name)) for name in frames}


BOUNDS = {  # rows per frame: buckets times lines, whatever the number of ranks
    "step_time": SLOWEST_RANKS * STEPS,
    "step_spread": STEPS,
    "phases": (1 + SLOWEST_RANKS) * len(PHASES),
    "series": METRICS * SLOWEST_RANKS * TIME_BUCKETS,
    "series_spread": METRICS * TIME_BUCKETS,
}


def test_the_loaders_return_rows_per_bucket_not_per_rank(wide, sixteen):
    for data in (wide, sixteen):  # 64 times the ranks, the same bound
        sizes = _sizes(data)
        assert all(sizes[name] <= bound for name, bound in BOUNDS.items()), sizes
        assert sizes["series"] >= 0.9 * BOUNDS["series"]  # a sample may jitter out of a bucket
    assert _sizes(wide)["step_time"] == _sizes(sixteen)["step_time"] == BOUNDS["step_time"]
    assert (wide.step_spread["n_ranks"] == 1024).all()
    spread = wide.series_spread
    assert (spread["min"] <= spread["p10"]).all() and (spread["p10"] <= spread["median"]).all()
    assert (spread["median"] <= spread["p90"]).all() and (spread["p90"] <= spread["max"]).all()


def test_the_slowest_ranks_keep_their_own_lines_and_bars(wide):
    assert wide.slowest[0] == STRAGGLER and len(wide.slowest) == SLOWEST_RANKS
    assert list(dict.fromkeys(wide.step_time["rank"])) == wide.slowest
    for _, per_rank, _ in wide.metric_frames():
        assert list(dict.fromkeys(per_rank["rank"])) == wide.slowest
    bars = list(dict.fromkeys(wide.phases["bar"]))
    assert bars == ["median"] + [f"rank {r}" for r in wide.slowest]
    forward = wide.phases[wide.phases["phase"] == "forward"].set_index("bar")["seconds"]
    assert forward[f"rank {STRAGGLER}"] > 1.2 * forward["median"]


def test_the_charts_name_the_slowest_ranks_within_altairs_row_limit(wide):
    chart = charts.rank_lines(wide.step_time, wide.step_spread, "step", "duration_s",
                              title="Step time per rank", y_title="seconds")  # fmt: skip
    spec = chart.to_dict()  # raises MaxRowsError past 5,000 rows
    assert sum(len(rows) for rows in spec["datasets"].values()) <= (2 + SLOWEST_RANKS) * STEPS
    domain = spec["layer"][-1]["encoding"]["color"]["scale"]["domain"]
    assert domain == ["median", "rank 700", *(f"rank {r}" for r in wide.slowest[1:])]
    assert "1,024 ranks" in spec["title"]["subtitle"]
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["area", "area", "line"]
    bar = charts.phases_bar(wide.phases).to_dict()
    assert bar["encoding"]["x"]["field"] == "bar" and bar["encoding"]["x"]["sort"][1] == "rank 700"


def _artists(fig) -> int:
    return sum(len(ax.lines) + len(ax.collections) + len(ax.patches) for ax in fig.axes)


def test_the_report_figures_draw_a_bounded_number_of_artists(wide):
    """1,024 lines, 6,144 bars and 3,072 lines took ~0.5, ~3 and ~2 s to draw."""
    step = figures.step_time_figure(wide)
    assert _artists(step) == 2 + 1 + SLOWEST_RANKS  # two bands, the median, the slowest
    labels = [t.get_text() for t in step.axes[0].get_legend().get_texts()]
    assert "median of 1,024 ranks" in labels and f"rank {STRAGGLER}" in labels
    assert _artists(figures.phases_figure(wide)) == (1 + SLOWEST_RANKS) * len(PHASES)
    phases = figures.phases_figure(wide).axes[0]
    assert [t.get_text() for t in phases.get_xticklabels()][:2] == ["median", "rank 700"]
    assert _artists(figures.series_figure(wide)) == METRICS * (2 + 1 + SLOWEST_RANKS)


def test_a_run_of_up_to_line_ranks_keeps_a_line_and_a_bar_per_rank(tmp_path):
    data = load_overview(store.open(make_wide_run(tmp_path / "eight", ranks=LINE_RANKS,
                                                  seconds=2.0)))  # fmt: skip
    ranks = list(range(LINE_RANKS))
    assert sorted(set(data.step_time["rank"])) == ranks and data.step_spread.empty
    assert sorted(set(data.series["rank"])) == ranks and data.series_spread.empty
    assert data.slowest == [] and sorted(set(data.phases["rank"])) == ranks
    same = charts.lines(data.step_time, "step", "duration_s", title="t", y_title="s")
    chart = charts.rank_lines(data.step_time, data.step_spread, "step", "duration_s",
                              title="t", y_title="s")  # fmt: skip
    assert chart.to_dict() == same.to_dict()
    assert chart.to_dict()["encoding"]["color"]["field"] == "rank"
    assert charts.phases_bar(data.phases).to_dict()["encoding"]["x"]["field"] == "rank"
    assert len(figures.step_time_figure(data).axes[0].lines) == LINE_RANKS
    assert len(figures.phases_figure(data).axes[0].patches) == LINE_RANKS * len(PHASES)
    nine = load_overview(store.open(make_wide_run(tmp_path / "nine", ranks=LINE_RANKS + 1,
                                                  seconds=2.0)))  # fmt: skip
    assert len(set(nine.step_time["rank"])) == SLOWEST_RANKS and not nine.step_spread.empty


def test_the_stragglers_table_lists_the_slowest_first_and_counts_the_rest(wide, sixteen):
    compute = wide.stragglers["compute_s"]
    assert int(wide.stragglers["rank"].iloc[0]) == STRAGGLER
    assert compute.is_monotonic_decreasing and len(wide.stragglers) == 1024
    table = straggler_table(wide.stragglers)
    assert len(table.rows) == STRAGGLER_ROWS and table.hidden == 1024 - STRAGGLER_ROWS
    pd.testing.assert_frame_equal(table.rows, wide.stragglers.head(STRAGGLER_ROWS))
    assert table.note == "1,004 faster ranks not listed."
    small = straggler_table(sixteen.stragglers)
    assert len(small.rows) == 16 and small.hidden == 0 and small.note == ""


def test_the_reports_stragglers_table_is_the_same(tmp_path):
    run = make_wide_run(tmp_path / "run", ranks=64, seconds=2.0, straggler=40, samples=False)
    (out,) = render_report(run, html=tmp_path / "r.html")
    section = out.read_text().split("<h2>Stragglers")[1].split("<h2>")[0]
    ranks = [int(r) for r in re.findall(r"<tr>\s*<td>(\d+)</td>", section)]  # first column
    assert ranks[0] == 40 and len(ranks) == STRAGGLER_ROWS
    assert "<p>44 faster ranks not listed.</p>" in section
