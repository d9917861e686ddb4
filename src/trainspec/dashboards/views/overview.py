"""Overview: step time and phases per rank, utilization, memory, latency, gradients, heatmap."""

from __future__ import annotations

import streamlit as st

from trainspec.dashboards import charts
from trainspec.dashboards.data import (
    LATENCY_METRIC,
    LINE_RANKS,
    MEMORY_METRIC,
    OverviewData,
    load_overview,
)
from trainspec.dashboards.stragglers import straggler_table
from trainspec.dashboards.views import ViewContext

SERIES_TITLES = {
    "trainspec.gpu.utilization": ("GPU utilization", "fraction of time busy", ".0%"),
    "trainspec.process.cpu.utilization": ("CPU utilization (process)", "share of cores", ".0%"),
    MEMORY_METRIC: ("Memory pressure", "fraction in use", ".0%"),
    LATENCY_METRIC: ("Collective latency (probe all-reduce)", "seconds", ".2~s"),
}
STRAGGLER_RATIO = 1.2  # 20% slower than the median rank: worth a look (detector's default)
MAX_WARNINGS = 5  # one box per straggler; a whole slow node of a big job is in the table


def _headline(ctx: ViewContext, data: OverviewData) -> None:
    s = data.summary
    cols = st.columns(5)
    cols[0].metric("ranks", s.ranks_text)
    cols[1].metric("steps", s.steps)
    cols[2].metric("samples rows", f"{s.sample_rows:,}")
    cols[3].metric("span", f"{s.span_s:,.0f} s")
    cols[4].metric("device", s.device)
    if s.missing_rows_note():
        st.caption(s.missing_rows_note())
    if s.nonfinite:
        st.caption(f"{s.nonfinite:,} NaN or infinite values left out of every chart.")
    _warn_stragglers(data)


def _warn_stragglers(data: OverviewData) -> None:
    """A warning per rank at least STRAGGLER_RATIO x the median, the slowest MAX_WARNINGS."""
    slow = data.stragglers[data.stragglers["ratio"] >= STRAGGLER_RATIO]
    for row in slow.head(MAX_WARNINGS).itertuples():
        st.warning(
            f"Straggler: rank {row.rank} computes {row.ratio:.2f}x the median rank "
            f"({row.compute_s * 1000:.1f} ms per step)"
        )
    if len(slow) > MAX_WARNINGS:
        st.warning(f"{len(slow) - MAX_WARNINGS:,} more ranks compute at least "
                   f"{STRAGGLER_RATIO:g}x the median rank: see the stragglers table.")  # fmt: skip


def _stragglers_table(data: OverviewData) -> None:
    """The slowest ranks first; open by default once the line charts stop naming every rank."""
    table = straggler_table(data.stragglers)
    if table.rows.empty:
        return
    many = len(data.stragglers) > LINE_RANKS
    with st.expander("Stragglers: the slowest ranks first", expanded=many):
        st.dataframe(
            table.rows,
            hide_index=True,
            column_config={
                "compute_s": st.column_config.NumberColumn("compute s (median)", format="%.4f"),
                "ratio": st.column_config.NumberColumn("x median rank", format="%.2f"),
            },
        )
        if table.note:
            st.caption(table.note)


def render(ctx: ViewContext) -> None:
    data = load_overview(ctx.con, ctx.points)
    st.subheader("Overview")
    if data.summary.steps == 0 and data.summary.sample_rows == 0:
        st.info("This run has no steps or samples yet.")
        return
    _headline(ctx, data)
    if not data.heatmap.empty:
        st.altair_chart(charts.rank_heatmap(data.heatmap), width="stretch")
    _stragglers_table(data)
    left, right = st.columns(2)
    if not (data.step_time.empty and data.step_spread.empty):
        left.altair_chart(
            charts.rank_lines(data.step_time, data.step_spread, "step", "duration_s",
                              title="Step time per rank", y_title="seconds"),
            width="stretch",
        )  # fmt: skip
        right.altair_chart(charts.phases_bar(data.phases), width="stretch")
    cols = st.columns(3)
    for i, (metric, per_rank, spread) in enumerate(data.metric_frames()):
        title, y_title, fmt = SERIES_TITLES.get(metric, (metric, "value", None))
        cols[i % 3].altair_chart(
            charts.rank_lines(per_rank, spread, "t", "value", title=title, y_title=y_title,
                              x_title="seconds since start", y_format=fmt),
            width="stretch",
        )  # fmt: skip
    grads = data.gradients.dropna(subset=["grad_variance", "grad_noise_scale"], how="all")
    if grads.empty:
        st.caption("No gradient statistics in this run (single rank, or the hook was off).")
        return
    left, right = st.columns(2)
    left.altair_chart(
        charts.lines(grads, "step", "grad_variance", color="", title="Gradient variance",
                     y_title="tr(Σ) estimate"),
        width="stretch",
    )  # fmt: skip
    right.altair_chart(
        charts.lines(grads, "step", "grad_noise_scale", color="",
                     title="Gradient noise scale (McCandlish et al. 2018)", y_title="samples"),
        width="stretch",
    )  # fmt: skip
