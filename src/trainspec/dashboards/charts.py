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
HEATMAP_ROW_PX = 40
HEATMAP_FRAME_PX = 110  # title, step axis and padding
HEATMAP_MAX_PX = 600  # 32 rows (the loader's most) at ~15 px each
# Many ranks: a blue band for the spread, a dark median, warm colors for the slowest ranks.
SPREAD_COLOR = "#4c78a8"
MEDIAN_COLOR = "#222222"
SLOWEST_COLORS = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
MEDIAN_LINE = "median"


def x_axis(x: str) -> alt.Axis:
    """Steps are whole numbers: a short run's step axis read 0.0, 0.2 ... 5.0."""
    return alt.Axis(format="d", tickMinStep=1) if x == "step" else alt.Axis()


def lines(
    df: pd.DataFrame, x: str, y: str, *, color: str = "rank", title: str, y_title: str,
    x_title: str | None = None, y_format: str | None = None,
) -> alt.Chart:  # fmt: skip
    axis = alt.Axis(format=y_format) if y_format else alt.Axis()
    enc = {
        "x": alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(nice=False), axis=x_axis(x)),
        "y": alt.Y(f"{y}:Q", title=y_title, axis=axis),
        "tooltip": [c for c in (x, y, color) if c in df.columns],
    }
    if color in df.columns:
        enc["color"] = alt.Color(f"{color}:N", title=color)
    return alt.Chart(df, title=title).mark_line().encode(**enc).properties(height=220)


def _spread_title(title: str, spread: pd.DataFrame) -> alt.TitleParams:
    # Short: a third of the page wide, a longer subtitle is cut off. The legend names the rest.
    ranks = int(spread["n_ranks"].max()) if len(spread) else 0
    return alt.TitleParams(title, subtitle=f"{ranks:,} ranks: median, p10-p90, min-max")


def _spread_lines(per_rank: pd.DataFrame, spread: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """x, y, line: the median ("median") and each slowest rank ("rank 700"), in that order."""
    median = spread[[x, "median"]].rename(columns={"median": y}).assign(line=MEDIAN_LINE)
    ranks = per_rank[[x, y]].assign(line="rank " + per_rank["rank"].astype(str))
    return pd.concat([median, ranks], ignore_index=True)


def _line_colors(count: int) -> list[str]:
    """The median's color, then one per slowest rank (cycling past the palette's five)."""
    return [MEDIAN_COLOR, *(SLOWEST_COLORS[i % len(SLOWEST_COLORS)] for i in range(count - 1))]


def rank_lines(
    per_rank: pd.DataFrame, spread: pd.DataFrame, x: str, y: str, *, title: str, y_title: str,
    x_title: str | None = None, y_format: str | None = None,
) -> alt.Chart | alt.LayerChart | alt.FacetChart:  # fmt: skip
    """A line per rank; or, where the loader summarized many ranks (`spread` not empty), the
    spread across ranks per bucket (median line, p10-p90 and min-max bands) and the slowest
    ranks (`per_rank`) as their own labelled lines: O(buckets) rows, whatever the ranks."""
    if spread.empty:
        return lines(per_rank, x, y, title=title, y_title=y_title, x_title=x_title,
                     y_format=y_format)  # fmt: skip
    axis = alt.Axis(format=y_format) if y_format else alt.Axis()
    xq = alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(nice=False), axis=x_axis(x))
    bands = [
        alt.Chart(spread)
        .mark_area(color=SPREAD_COLOR, opacity=opacity)
        .encode(x=xq, y=alt.Y(f"{lo}:Q", title=y_title, axis=axis), y2=f"{hi}:Q")
        for lo, hi, opacity in (("min", "max", 0.15), ("p10", "p90", 0.3))
    ]
    shown = _spread_lines(per_rank, spread, x, y)
    names = list(dict.fromkeys(shown["line"]))
    line = (
        alt.Chart(shown)
        .mark_line()
        .encode(
            x=xq,
            y=alt.Y(f"{y}:Q", title=y_title, axis=axis),
            color=alt.Color(
                "line:N", title=None, sort=names,
                scale=alt.Scale(domain=names, range=_line_colors(len(names))),
            ),
            tooltip=[x, alt.Tooltip(f"{y}:Q", format=y_format) if y_format else y, "line"],
        )
    )  # fmt: skip
    return alt.layer(*bands, line, title=_spread_title(title, spread)).properties(height=220)


def phases_bar(df: pd.DataFrame) -> alt.Chart:
    """A stacked bar per rank, or (when the loader summarized many ranks: a "median" bar
    without a rank) the median bar and the slowest ranks' bars, labelled."""
    order = list(df["phase"].unique())
    df = df.assign(phase_order=df["phase"].map({p: i for i, p in enumerate(order)}))
    seconds = alt.Tooltip("seconds:Q", format=".4f")
    if df["rank"].isna().any():
        bars = list(dict.fromkeys(df["bar"]))
        df = df.drop(columns="rank")  # NA on the median bar: its label says what it is
        x = alt.X("bar:N", title=None, sort=bars, axis=alt.Axis(labelAngle=0))
        title = "Step phases per step: median and slowest ranks"
        tooltip = ["bar", "phase", seconds]
    else:  # a bar per rank, as it always was
        df = df.drop(columns="bar")
        x = alt.X("rank:N", title="rank", axis=alt.Axis(labelAngle=0))
        title = "Step phases per rank (mean per step)"
        tooltip = ["rank", "phase", seconds]
    return (
        alt.Chart(df, title=title)
        .mark_bar()
        .encode(
            x=x,
            y=alt.Y("seconds:Q", title="seconds", stack="zero"),
            color=alt.Color("phase:N", sort=order),
            order=alt.Order("phase_order:Q"),
            tooltip=tooltip,
        )
        .properties(height=220)
    )


def _heatmap_height(rows: int) -> int:
    # Streamlit fits title, axes and legend inside the height: leave room for them.
    return min(HEATMAP_ROW_PX * rows + HEATMAP_FRAME_PX, HEATMAP_MAX_PX)


def rank_heatmap(df: pd.DataFrame) -> alt.Chart:
    """One row per rank, or per group of consecutive ranks (`0-31`, colored by its slowest
    rank, named in the tooltip) when the loader grouped them: never taller than 600 px."""
    ms = df.assign(compute_ms=df["compute_s"] * 1000.0)
    rows = list(ms.drop_duplicates("ranks").sort_values("rank")["ranks"])
    grouped = bool((ms["rank_end"] > ms["rank"]).any())
    height = _heatmap_height(len(rows))
    # ~15 px a row at 32 rows: a smaller font, or Vega drops every other label (the bright one).
    axis = alt.Axis(labelOverlap=False, labelFontSize=9) if len(rows) > 16 else alt.Axis()
    title = "Compute time per rank over steps (ms): a straggler is a bright row"
    return (
        alt.Chart(ms, title=title + (" (slowest rank of each group)" if grouped else ""))
        .mark_rect()
        .encode(
            x=alt.X(
                "step:Q", title="step", scale=alt.Scale(nice=False, zero=False), axis=x_axis("step")
            ),
            x2="step_end:Q",
            y=alt.Y("ranks:O", title="ranks" if grouped else "rank", sort=rows, axis=axis),
            color=alt.Color(
                "compute_ms:Q",
                title="ms",
                scale=alt.Scale(scheme="inferno"),
                legend=alt.Legend(gradientLength=max(60, height - HEATMAP_FRAME_PX)),
            ),
            tooltip=[
                alt.Tooltip("ranks:O", title="ranks" if grouped else "rank"),
                alt.Tooltip("slowest_rank:Q", title="slowest rank"),
                "step",
                alt.Tooltip("compute_ms:Q", format=".1f"),
            ],
        )
        .properties(height=height)
    )


def event_timeline(
    timeline: pd.DataFrame, events: pd.DataFrame
) -> alt.Chart | alt.LayerChart | alt.FacetChart:
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
