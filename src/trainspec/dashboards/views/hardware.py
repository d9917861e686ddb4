"""Hardware: one line per physical GPU for every GPU series (GPU 0 of two nodes are two
lines, `data.load_hardware`), when the run had GPUs."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from trainspec.dashboards import charts
from trainspec.dashboards.data import load_hardware
from trainspec.dashboards.views import ViewContext

NO_GPUS = "no GPUs in this run"


def render(ctx: ViewContext) -> None:
    data = load_hardware(ctx.con, ctx.points)
    st.subheader("Hardware")
    if not data.gpus and data.series.empty:
        st.info(NO_GPUS)
        return
    if data.gpus:
        st.dataframe(pd.DataFrame(data.gpus), hide_index=True)
    if data.series.empty:
        st.info("The run lists GPUs but recorded no GPU series (NVML unavailable?).")
        return
    cols = st.columns(2)
    for i, (metric, frame) in enumerate(data.series.groupby("metric", sort=True)):
        short = metric.removeprefix("trainspec.")
        cols[i % 2].altair_chart(
            charts.lines(frame, "t", "value", color="gpu", title=short, y_title=short,
                         x_title="seconds since start"),
            width="stretch",
        )  # fmt: skip
