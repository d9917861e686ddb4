"""The dashboard's views: each module renders one page from `trainspec.dashboards.data`.

A view is `render(ctx: ViewContext) -> None`; `VIEWS` maps the title shown in the sidebar
to it. Views only draw: every query lives in `data`, so the benchmark times what they show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import duckdb

from trainspec.dashboards.runs import RunEntry


@dataclass
class ViewContext:
    con: duckdb.DuckDBPyConnection  # views over the selected run
    entry: RunEntry  # the selected run
    runs: list[RunEntry]  # every run under the root, for Compare
    points: int  # buckets per series


def _views() -> dict[str, Callable[[ViewContext], None]]:
    from trainspec.dashboards.views import actions, compare, compliance, hardware, overview

    return {
        "Overview": overview.render,
        "Actions": actions.render,
        "Compliance": compliance.render,
        "Compare": compare.render,
        "Hardware": hardware.render,
    }


VIEW_NAMES = ("Overview", "Actions", "Compliance", "Compare", "Hardware")


def view(name: str) -> Callable[[ViewContext], None]:
    return _views()[name]
