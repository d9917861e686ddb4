"""Compare: two runs side by side (headline statistics, step time and throughput)."""

from __future__ import annotations

import streamlit as st

from trainspec import store
from trainspec.dashboards import charts
from trainspec.dashboards.data import load_compare
from trainspec.dashboards.views import ViewContext


def render(ctx: ViewContext) -> None:
    st.subheader("Compare runs")
    others = [e for e in ctx.runs if e.path != ctx.entry.path]
    if not others:
        st.info("Only one run under this root: nothing to compare with.")
        return
    other = st.selectbox("compare with", others, format_func=lambda e: e.name, key="compare_b")
    if other is None:  # a selectbox over options, none preselected away: not reached
        other = others[0]
    con_b = store.open(other.path)
    try:
        data = load_compare(ctx.con, con_b, ctx.points)
    finally:
        con_b.close()
    st.caption(f"A = {ctx.entry.name}, B = {other.name}; ratio is B / A")
    st.dataframe(data.stats, hide_index=True)
    left, right = st.columns(2)
    left.altair_chart(
        charts.lines(data.curves, "step", "duration_s", color="run",
                     title="Step time (slowest rank)", y_title="seconds"),
        width="stretch",
    )  # fmt: skip
    right.altair_chart(
        charts.lines(data.curves, "step", "throughput", color="run",
                     title="Throughput (all ranks)", y_title="samples/s"),
        width="stretch",
    )  # fmt: skip
