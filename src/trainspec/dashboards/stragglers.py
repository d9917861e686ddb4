"""Which ranks are slow: every rank's median compute time, the slowest first.

The overview warns about the ranks at least 1.2x the median, lists the slowest in a table
and, beyond `LINE_RANKS` ranks, draws the `SLOWEST_RANKS` slowest as their own lines beside
the spread across ranks. The table keeps `STRAGGLER_ROWS` rows and says how many ranks it
leaves out: a 1,024-row table ordered by rank hid the one slow rank on page 35.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pandas as pd

from trainspec.dashboards.sql import COMPUTE_SQL, finite

SLOWEST_RANKS = 3  # beyond LINE_RANKS, these slowest ranks keep their own line and bar
STRAGGLER_ROWS = 20  # the stragglers table lists the slowest ranks, then says how many more


@dataclass
class StragglerTable:
    rows: pd.DataFrame  # the slowest ranks: rank, compute_s, ratio; slowest first
    hidden: int  # ranks left out, none slower than a listed one

    @property
    def note(self) -> str:
        """The line under the table saying how many ranks it leaves out ("" for none)."""
        if not self.hidden:
            return ""
        ranks = "rank" if self.hidden == 1 else "ranks"
        return f"{self.hidden:,} faster {ranks} not listed."


def load_stragglers(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Median compute time per rank, and its ratio to the median over ranks (1.6 = 60% slower),
    slowest rank first (a rank without a finite compute time last)."""
    return con.execute(
        f"""
        WITH per_rank AS (
            SELECT rank, {finite("median", COMPUTE_SQL)} AS compute_s FROM steps GROUP BY rank)
        SELECT rank, compute_s, compute_s / nullif(median(compute_s) OVER (), 0) AS ratio
        FROM per_rank ORDER BY compute_s DESC NULLS LAST, rank
        """
    ).df()


def slowest_ranks(stragglers: pd.DataFrame, count: int = SLOWEST_RANKS) -> list[int]:
    """The `count` slowest ranks of `load_stragglers`' frame, slowest first."""
    timed = _slowest_first(stragglers.dropna(subset=["compute_s"]))
    return [int(r) for r in timed["rank"][:count]]


def straggler_table(stragglers: pd.DataFrame, rows: int = STRAGGLER_ROWS) -> StragglerTable:
    """The stragglers table as the app and the report show it: the `rows` slowest ranks."""
    return StragglerTable(
        rows=_slowest_first(stragglers).head(rows), hidden=max(len(stragglers) - rows, 0)
    )


def _slowest_first(stragglers: pd.DataFrame) -> pd.DataFrame:
    # The loader's order, kept for a frame that was filtered or reordered since.
    return stragglers.sort_values(["compute_s", "rank"], ascending=[False, True])
