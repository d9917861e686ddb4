"""Altair chart builders for the Streamlit views (Vega-Lite rendered in the browser)."""

from __future__ import annotations

import altair as alt
import pandas as pd

EVENT_COLORS = {
    "anomaly": "#d62728",
    "action": "#2ca02c",
    "fault": "#9467bd",
    "checkpoint": "#7f7f7f",
}


def lines(
    df: pd.DataFrame, x: str, y: str, *, color: str = "rank", title: str, y_title: str,
    x_title: str | None = None, y_format: str | None = None,
) -> alt.Chart:  # fmt: skip
    axis = alt.Axis(format=y_format) if y_format else alt.Axis()
    enc = {
        "x": alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(nice=False)),
        "y": alt.Y(f"{y}:Q", title=y_title, axis=axis),
        "tooltip": [c for c in (x, y, color) if c in df.columns],
    }
    if color in df.columns:
        enc["color"] = alt.Color(f"{color}:N", title=color)
    return alt.Chart(df, title=title).mark_line().encode(**enc).properties(height=220)


def phases_bar(df: pd.DataFrame) -> alt.Chart:
    order = list(df["phase"].unique())
    df = df.assign(phase_order=df["phase"].map({p: i for i, p in enumerate(order)}))
    return (
        alt.Chart(df, title="Step phases per rank (mean per step)")
        .mark_bar()
        .encode(
            x=alt.X("rank:N", title="rank", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("seconds:Q", title="seconds", stack="zero"),
            color=alt.Color("phase:N", sort=order),
            order=alt.Order("phase_order:Q"),
            tooltip=["rank", "phase", alt.Tooltip("seconds:Q", format=".4f")],
        )
        .properties(height=220)
    )


def rank_heatmap(df: pd.DataFrame) -> alt.Chart:
    # Ranks as quantitative bands (rank +- 0.5), like steps on x: every cell is a plain rect.
    ms = df.assign(compute_ms=df["compute_s"] * 1000.0, y0=df["rank"] - 0.5, y1=df["rank"] + 0.5)
    ranks = sorted(int(r) for r in ms["rank"].unique())
    return (
        alt.Chart(ms, title="Compute time per rank over steps (ms): a straggler is a bright row")
        .mark_rect()
        .encode(
            x=alt.X("step:Q", title="step", scale=alt.Scale(nice=False, zero=False)),
            x2="step_end:Q",
            y=alt.Y(
                "y0:Q",
                title="rank",
                scale=alt.Scale(reverse=True, nice=False, zero=False),
                axis=alt.Axis(values=ranks, format="d"),
            ),
            y2="y1:Q",
            color=alt.Color(
                "compute_ms:Q",
                title="ms",
                scale=alt.Scale(scheme="inferno"),
                legend=alt.Legend(gradientLength=max(60, 30 * len(ranks))),
            ),
            tooltip=["rank", "step", alt.Tooltip("compute_ms:Q", format=".1f")],
        )
        # Streamlit fits title, axes and legend inside the height: leave room for them.
        .properties(height=40 * len(ranks) + 110)
    )


def event_timeline(timeline: pd.DataFrame, events: pd.DataFrame) -> alt.Chart:
    base = lines(
        timeline, "step", "duration_s", color="", title="Step time (slowest rank) with events",
        y_title="seconds",
    )  # fmt: skip
    if events.empty:
        return base
    ev = events[["step", "kind", "name", "severity", "reason"]]
    rules = (
        alt.Chart(ev)
        .mark_rule(strokeWidth=2, strokeDash=[4, 2])
        .encode(
            x="step:Q",
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=list(EVENT_COLORS), range=list(EVENT_COLORS.values())),
            ),
            tooltip=["step", "kind", "name", "severity", "reason"],
        )
    )
    return alt.layer(base, rules)
