"""Matplotlib figures of the headline plots, for the static report (no server, no pyplot).

Figures are built on `matplotlib.figure.Figure` directly and saved through the Agg canvas,
so nothing touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from trainspec.dashboards.data import (
    HEATMAP_ROWS,
    LATENCY_METRIC,
    MEMORY_METRIC,
    ActionsData,
    OverviewData,
)

EVENT_COLORS = {"anomaly": "tab:red", "action": "tab:green", "fault": "tab:purple"}
SIZE = (8.0, 3.2)
# A legend of more ranks than this outgrows its axes (constrained layout then gives up
# with a warning) and names nothing a reader can match to a line anyway.
LEGEND_MAX_RANKS = 8
# Many ranks (the loader's spread): a blue band, a dark median, the slowest ranks in warm colors.
SPREAD_COLOR = "tab:blue"
MEDIAN_COLOR = "0.15"
SLOWEST_COLORS = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink")


def _per_rank(ax, frame, x: str, y: str) -> None:
    for rank, part in frame.groupby("rank"):
        ax.plot(part[x], part[y], label=f"rank {rank}", linewidth=1.2)
    if 1 < frame["rank"].nunique() <= LEGEND_MAX_RANKS:
        ax.legend(fontsize=7, loc="upper right")


def _spread(ax, spread: pd.DataFrame, per_rank: pd.DataFrame, x: str, y: str) -> None:
    """Bands of the spread across ranks, its median, and the slowest ranks' own lines: six
    artists where a line per rank drew 1,024 (seconds to draw, nothing to read)."""
    for lo, hi, alpha in (("min", "max", 0.15), ("p10", "p90", 0.3)):
        ax.fill_between(spread[x], spread[lo], spread[hi], color=SPREAD_COLOR, alpha=alpha,
                        linewidth=0, label=f"{lo}-{hi}")  # fmt: skip
    ranks = int(spread["n_ranks"].max())
    ax.plot(spread[x], spread["median"], color=MEDIAN_COLOR, linewidth=1.2,
            label=f"median of {ranks:,} ranks")  # fmt: skip
    for i, (rank, part) in enumerate(per_rank.groupby("rank", sort=False)):
        color = SLOWEST_COLORS[i % len(SLOWEST_COLORS)]
        ax.plot(part[x], part[y], color=color, linewidth=1.0, label=f"rank {rank}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


def _rank_lines(ax, per_rank: pd.DataFrame, spread: pd.DataFrame, x: str, y: str) -> None:
    """A line per rank, or the spread and the slowest ranks where the loader summarized."""
    if spread.empty:
        _per_rank(ax, per_rank, x, y)
    else:
        _spread(ax, spread, per_rank, x, y)


def _heatmap_height(rows: int) -> float:
    """Inches: the usual 3.2 up to 8 rows, growing to fit up to HEATMAP_ROWS (32) labels."""
    return min(max(SIZE[1], 1.4 + 0.17 * rows), 7.0)


def heatmap_figure(data: OverviewData) -> Figure:
    """One row per rank, or per group of consecutive ranks (its slowest rank) on big runs."""
    grid = data.heatmap.pivot(index="ranks", columns="step", values="compute_s") * 1000.0
    order = data.heatmap.drop_duplicates("ranks").sort_values("rank")["ranks"]
    grid = grid.loc[list(order)]
    fig = Figure(figsize=(SIZE[0], _heatmap_height(len(grid))), layout="constrained")
    ax = fig.add_subplot()
    steps = list(grid.columns)
    step_w = (steps[1] - steps[0]) if len(steps) > 1 else 1
    extent = (steps[0], steps[-1] + step_w, len(grid) - 0.5, -0.5)
    im = ax.imshow(grid.to_numpy(), aspect="auto", cmap="inferno", extent=extent,
                   interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(grid)), list(grid.index), fontsize=7 if len(grid) > 8 else None)
    grouped = bool((data.heatmap["rank_end"] > data.heatmap["rank"]).any())
    ax.set(
        xlabel="step",
        ylabel="ranks (slowest of each group)" if grouped else "rank",
        title="Compute time per rank (ms): a straggler is a bright row",
    )
    fig.colorbar(im, ax=ax, label="ms")
    return fig


def step_time_figure(data: OverviewData) -> Figure:
    fig = Figure(figsize=SIZE, layout="constrained")
    ax = fig.add_subplot()
    _rank_lines(ax, data.step_time, data.step_spread, "step", "duration_s")
    title = "Step time per rank" if data.step_spread.empty else "Step time across ranks"
    ax.set(xlabel="step", ylabel="seconds", title=title)
    return fig


def _phase_table(phases: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """Seconds per bar (rows, in the loader's order) and phase (columns, stacking order), and
    whether the loader summarized many ranks (a "median" bar, without a rank)."""
    summarized = bool(phases["rank"].isna().any())
    key = "bar" if summarized else "rank"
    wide = phases.pivot(index=key, columns="phase", values="seconds").fillna(0.0)
    wide = wide.loc[list(dict.fromkeys(phases[key]))]
    return wide[[p for p in phases["phase"].unique() if p in wide.columns]], summarized


def phases_figure(data: OverviewData) -> Figure:
    fig = Figure(figsize=SIZE, layout="constrained")
    ax = fig.add_subplot()
    wide, summarized = _phase_table(data.phases)
    xs = list(range(len(wide))) if summarized else [int(r) for r in wide.index]
    bottom = [0.0] * len(wide)
    for phase in wide.columns:
        ax.bar(xs, wide[phase], bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, wide[phase])]
    if summarized:
        ax.set_xticks(xs, list(wide.index))
        ax.set(ylabel="seconds", title="Step phases per step: median and slowest ranks")
    else:
        if len(xs) <= HEATMAP_ROWS:  # beyond, matplotlib's own integer ticks stay legible
            ax.set_xticks(xs)
        ax.set(xlabel="rank", ylabel="seconds", title="Step phases per rank (mean per step)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


def series_figure(data: OverviewData) -> Figure:
    fig = Figure(figsize=(8.0, 7.5), layout="constrained")
    frames = data.metric_frames()
    axes = fig.subplots(max(1, len(frames)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (metric, per_rank, spread) in zip(axes, frames):
        _rank_lines(ax, per_rank, spread, "t", "value")
        unit = "seconds" if metric == LATENCY_METRIC else "fraction"
        title = {MEMORY_METRIC: "Memory pressure", LATENCY_METRIC: "Collective latency (probe)"}
        ax.set(ylabel=unit, title=title.get(metric, metric.removeprefix("trainspec.")))
    axes[-1].set_xlabel("seconds since start")
    return fig


def gradients_figure(data: OverviewData) -> Figure | None:
    grads = data.gradients.dropna(subset=["grad_variance", "grad_noise_scale"], how="all")
    if grads.empty:
        return None
    fig = Figure(figsize=SIZE, layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(grads["step"], grads["grad_variance"], color="tab:blue")
    left.set(xlabel="step", title="Gradient variance")
    right.plot(grads["step"], grads["grad_noise_scale"], color="tab:orange")
    right.set(xlabel="step", ylabel="samples", title="Gradient noise scale")
    return fig


def events_figure(data: ActionsData) -> Figure:
    fig = Figure(figsize=SIZE, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(data.timeline["step"], data.timeline["duration_s"], color="black", linewidth=1)
    seen: set[str] = set()
    for ev in data.events.itertuples():
        color = EVENT_COLORS.get(ev.kind, "tab:gray")
        label = ev.kind if ev.kind not in seen else None
        seen.add(ev.kind)
        ax.axvline(ev.step, color=color, linestyle="--", linewidth=1.2, label=label)
    ax.set(xlabel="step", ylabel="seconds", title="Step time (slowest rank) with events")
    if seen:
        ax.legend(fontsize=7, loc="upper right")
    return fig


def headline_figures(overview: OverviewData, actions: ActionsData) -> dict[str, Figure]:
    """name -> figure, in the order the report shows them; absent data, absent figure."""
    out: dict[str, Figure] = {}
    if not overview.heatmap.empty:
        out["heatmap"] = heatmap_figure(overview)
        out["step_time"] = step_time_figure(overview)
        out["phases"] = phases_figure(overview)
    if not (overview.series.empty and overview.series_spread.empty):
        out["series"] = series_figure(overview)
    grads = gradients_figure(overview)
    if grads is not None:
        out["gradients"] = grads
    if not actions.timeline.empty:
        out["events"] = events_figure(actions)
    return out
