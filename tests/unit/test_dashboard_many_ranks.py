"""The rank heatmap of a 1,024-rank run: ranks grouped in SQL, chart and figure bounded.

It drew one 40 px row per rank: a 41,000 px chart, 1,024 x 120 cells sent to the browser.
"""

from __future__ import annotations

import pytest

import trainspec.store as store
from tests.helpers.dashboard_runs import make_wide_run
from trainspec.dashboards.charts import HEATMAP_MAX_PX, rank_heatmap
from trainspec.dashboards.data import HEATMAP_BINS, HEATMAP_ROWS, load_overview
from trainspec.dashboards.figures import heatmap_figure

RANKS = 1024
STRAGGLER = 700  # in the group 672-703


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    run = make_wide_run(
        tmp_path_factory.mktemp("wide") / "run-1024",
        ranks=RANKS,
        seconds=10.0,
        straggler=STRAGGLER,
        samples=False,
    )
    return load_overview(store.open(run))


def test_the_loader_groups_ranks_into_at_most_32_rows(wide):
    heat = wide.heatmap
    assert len(heat) <= HEATMAP_ROWS * HEATMAP_BINS
    labels = list(heat.drop_duplicates("ranks")["ranks"])
    assert len(labels) == HEATMAP_ROWS
    assert labels[0] == "0-31" and labels[-1] == "992-1023" and "672-703" in labels
    assert (heat["rank_end"] - heat["rank"] == 31).all()


def test_the_stragglers_group_is_the_bright_row_and_names_it(wide):
    per_group = wide.heatmap.groupby("ranks")["compute_s"].median().sort_values()
    assert per_group.index[-1] == "672-703"
    assert per_group.iloc[-1] > 1.15 * per_group.iloc[-2]  # a slowest-rank row, not a mean
    named = wide.heatmap[wide.heatmap["ranks"] == "672-703"]["slowest_rank"]
    assert named.mode()[0] == STRAGGLER
    assert int(wide.stragglers.sort_values("ratio").iloc[-1]["rank"]) == STRAGGLER


def test_the_chart_is_at_most_600_px_tall(wide):
    spec = rank_heatmap(wide.heatmap).to_dict()
    assert spec["height"] <= HEATMAP_MAX_PX
    assert spec["encoding"]["y"]["sort"][:2] == ["0-31", "32-63"]
    (rows,) = spec["datasets"].values()
    assert len(rows) <= HEATMAP_ROWS * HEATMAP_BINS


def test_the_report_figure_labels_the_groups(wide):
    fig = heatmap_figure(wide)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == HEATMAP_ROWS and labels[21] == "672-703"
    assert fig.get_figheight() <= 7.0


def test_a_few_ranks_keep_one_row_each(tmp_path):
    run = make_wide_run(tmp_path / "four", ranks=4, seconds=2.0, samples=False)
    heat = load_overview(store.open(run)).heatmap
    assert list(heat.drop_duplicates("ranks")["ranks"]) == ["0", "1", "2", "3"]
    assert (heat["rank_end"] == heat["rank"]).all() and (heat["slowest_rank"] == heat["rank"]).all()
    assert rank_heatmap(heat).to_dict()["height"] == 4 * 40 + 110


def test_a_rank_near_the_int32_limit_is_grouped_without_overflow(tmp_path):
    """`first_rank + g - 1` was INT32 arithmetic: a rank of 2^31 - 1 failed the report with
    "Overflow in addition of INT32", said to be the run's damage."""
    from trainspec.store import SegmentWriter
    from trainspec.store.tables import to_arrow

    run = make_wide_run(tmp_path / "top", ranks=2, seconds=2.0, samples=False)
    top = 2**31 - 1
    SegmentWriter(run, "steps", "odd").write(
        to_arrow("steps", {"ts": [1.0], "rank": [top], "step": [0], "duration_s": [0.1]})
    )
    heat = load_overview(store.open(run)).heatmap
    assert heat["rank_end"].max() == top
