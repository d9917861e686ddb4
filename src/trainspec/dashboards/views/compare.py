"""Compare: two runs side by side (headline statistics, step time and throughput)."""

from __future__ import annotations

import streamlit as st

from trainspec import store
from trainspec.dashboards import charts
from trainspec.dashboards.data import load_compare
from trainspec.dashboards.skipped import skipped_warning
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
        skipped_b = store.skipped_segments(con_b)  # found while B's queries read
    finally:
        con_b.close()
    if skipped_b:  # A's are named above the view, as on every view
        st.warning(skipped_warning(skipped_b, run=f"B ({other.name})", where="B's figures"))
    st.caption(f"A = {ctx.entry.name}, B = {other.name}; ratio is B / A. Only steps every "
               "rank reported count: a step some ranks have not (yet) reported is left out.")  # fmt: skip
    if any(data.partial):
        part_a, part_b = data.partial
        st.caption(f"Left out, reported by only some ranks: {part_a:,} steps of A, "
                   f"{part_b:,} of B.")  # fmt: skip
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
