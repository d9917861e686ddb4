"""SQL fragments the loaders share: aggregates over finite values only.

One NaN in a bucket makes DuckDB's `avg` NaN, and one +inf makes `max` (and `avg`) inf:
a single bad step would blank a whole chart. Every aggregate a dashboard shows therefore
skips NaN and +-inf (`isfinite`); NULL stays NULL (a bucket with no finite value is NULL,
never 0), and `RunSummary.nonfinite` says how many values were left out.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from trainspec.store.tables import STEPS

# A rank's compute: forward + backward less the gradient-sync wait (backward includes it:
# catalogue), so a rank waiting for a straggler does not look slow itself.
COMPUTE_SQL = "forward_s + backward_s - coalesce(comm_exposed_s, 0)"
# The steps table's measured values (not its timestamp): what `nonfinite_count` inspects.
STEP_VALUE_COLUMNS = tuple(f.name for f in STEPS if pa.types.is_floating(f.type) and f.name != "ts")


def finite(agg: str, expr: str, *args: str) -> str:
    """`agg(expr, *args)` over the rows where `expr` is finite, e.g. `finite("avg", "loss")`."""
    call = ", ".join((expr, *args))
    return f"{agg}({call}) FILTER (WHERE isfinite({expr}))"


def spread(expr: str) -> str:
    """Select items: how `expr` spreads over the grouped rows (ranks), finite values only.

    `n_ranks` (how many rows had a finite value), `median`, `p10`, `p90`, `min`, `max`. Used
    over one row per rank and bucket: a bucket's band across ranks, O(buckets) rows whatever
    the number of ranks.
    """
    items = {
        "n_ranks": f"count({expr}) FILTER (WHERE isfinite({expr}))",
        "median": finite("median", expr),
        "p10": finite("quantile_cont", expr, "0.1"),
        "p90": finite("quantile_cont", expr, "0.9"),
        "min": finite("min", expr),
        "max": finite("max", expr),
    }
    return ", ".join(f'{sql} AS "{name}"' for name, sql in items.items())


def nonfinite_count(columns: tuple[str, ...] | list[str]) -> str:
    """An aggregate: how many NaN or +-inf values `columns` hold (NULLs are not counted)."""
    return " + ".join(f"count(*) FILTER (WHERE NOT isfinite({c}))" for c in columns)


def one_row(result: Any) -> tuple[Any, ...]:
    """The row of an executed query that always has exactly one (an aggregate with no GROUP
    BY); raises LookupError, naming the query's absence of rows, if it had none."""
    row = result.fetchone()
    if row is None:
        raise LookupError("an aggregate query returned no row")
    return tuple(row)
