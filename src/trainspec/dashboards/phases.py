"""Where a step's time goes: each phase's mean seconds per step, a stacked bar per rank.

Up to `LINE_RANKS` ranks there is a bar per rank. Beyond, a bar per rank is a comb of
1,024 slivers that names no rank: there is a "median" bar (each phase's median over every
rank) and a bar per slowest rank, which is what a reader compares. Computed in SQL, so the
chart gets at most 1 + SLOWEST_RANKS bars whatever the rank count.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from trainspec.dashboards.sql import finite

PHASES = ("data_wait", "forward", "backward compute", "comm exposed", "optimizer", "other")
# Each measured phase's SQL: PHASES less "other", the rest of the step. Backward includes
# the gradient-sync wait (catalogue): its compute part leaves the exposed communication out.
PHASE_SQL = {
    "data_wait": "data_wait_s",
    "forward": "forward_s",
    "backward compute": "backward_s - coalesce(comm_exposed_s, 0)",
    "comm exposed": "coalesce(comm_exposed_s, 0)",
    "optimizer": "optimizer_s",
}
MEDIAN_BAR = "median"


def _column(name: str) -> str:
    """A phase's name as a quoted SQL identifier ("backward compute")."""
    return f'"{name}"'


def _phase_ctes() -> str:
    """CTEs `means` and `per_rank`: each rank's mean per step of every phase (PHASES), where
    "other" is the rest of the mean step, never below 0 (NULL when the step time is)."""
    means = ", ".join(f"{finite('avg', sql)} AS {_column(n)}" for n, sql in PHASE_SQL.items())
    known = " + ".join(f"coalesce({_column(n)}, 0)" for n in PHASE_SQL)
    return f"""
        means AS (
            SELECT rank, {means}, {finite("avg", "duration_s")} AS total FROM steps GROUP BY rank),
        per_rank AS (
            SELECT * EXCLUDE (total),
                   CASE WHEN total IS NOT NULL THEN greatest(total - ({known}), 0) END AS "other"
            FROM means)"""


def _phase_bars_sql(slowest: list[int] | None) -> str:
    """A bar per rank (`slowest` None), or a "median" bar (each phase's median over every
    rank) and one per rank of `$ranks`, in that order."""
    if slowest is None:
        return f"WITH {_phase_ctes()} SELECT 'rank ' || rank AS bar, * FROM per_rank ORDER BY rank"
    medians = ", ".join(f"{finite('median', _column(p))} AS {_column(p)}" for p in PHASES)
    return f"""
        WITH {_phase_ctes()},
        bars AS (
            SELECT 0 AS pos, '{MEDIAN_BAR}' AS bar, NULL::INTEGER AS rank, {medians} FROM per_rank
            UNION ALL
            SELECT list_position($ranks, rank), 'rank ' || rank, * FROM per_rank
            WHERE list_contains($ranks, rank))
        SELECT * EXCLUDE (pos) FROM bars ORDER BY pos"""


def load_phases(
    con: duckdb.DuckDBPyConnection, *, slowest: list[int] | None = None
) -> pd.DataFrame:
    """Mean seconds per step of each phase: bar, rank, phase, seconds (long, for stacking).

    A bar per rank (`bar` "rank 3"), or with `slowest` a "median" bar (rank NA) followed by
    the bars of the `slowest` ranks in their order.
    """
    params = {} if slowest is None else {"ranks": list(slowest)}
    wide = con.execute(_phase_bars_sql(slowest), params).df()
    if wide.empty:
        return pd.DataFrame(columns=["bar", "rank", "phase", "seconds"])
    long = wide.melt(id_vars=["bar", "rank"], value_vars=list(PHASES), var_name="phase")
    return long.rename(columns={"value": "seconds"})
