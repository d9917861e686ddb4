"""Chart specs the dashboard hands to Vega-Lite."""

from __future__ import annotations

import pandas as pd

from trainspec.dashboards import charts


def _x_axis(spec: dict) -> dict:
    layers = spec.get("layer", [spec])
    return next(layer["encoding"]["x"] for layer in layers if "encoding" in layer)["axis"]


def test_step_axes_tick_whole_steps_on_a_short_run() -> None:
    """A 5-step run's step axis read 0.0, 0.2 ... 5.0 (QA, 2026-11-27)."""
    df = pd.DataFrame({"step": range(5), "duration_s": [0.1] * 5, "rank": [0] * 5})
    for chart in (
        charts.lines(df, "step", "duration_s", title="t", y_title="s"),
        charts.event_timeline(df, pd.DataFrame()),
    ):
        axis = _x_axis(chart.to_dict())
        assert axis == {"format": "d", "tickMinStep": 1}
    heat = pd.DataFrame({"step": [0, 1], "step_end": [1, 2], "rank": [0, 0], "rank_end": [0, 0],
                         "ranks": ["0", "0"], "slowest_rank": [0, 0], "compute_s": [0.1, 0.2]})  # fmt: skip
    assert _x_axis(charts.rank_heatmap(heat).to_dict())["tickMinStep"] == 1


def test_a_time_axis_keeps_vega_lites_own_ticks() -> None:
    df = pd.DataFrame({"t": [0.0, 0.5], "value": [1.0, 2.0], "gpu": [0, 0]})
    assert (
        _x_axis(charts.lines(df, "t", "value", color="gpu", title="t", y_title="v").to_dict()) == {}
    )
