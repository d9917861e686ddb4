"""SQL fragments the loaders share: aggregates over finite values only.

One NaN in a bucket makes DuckDB's `avg` NaN, and one +inf makes `max` (and `avg`) inf:
a single bad step would blank a whole chart. Every aggregate a dashboard shows therefore
skips NaN and +-inf (`isfinite`); NULL stays NULL (a bucket with no finite value is NULL,
never 0), and `RunSummary.nonfinite` says how many values were left out.
"""

from __future__ import annotations

import pyarrow as pa

from trainspec.store.tables import STEPS

# The steps table's measured values (not its timestamp): what `nonfinite_count` inspects.
STEP_VALUE_COLUMNS = tuple(f.name for f in STEPS if pa.types.is_floating(f.type) and f.name != "ts")


def finite(agg: str, expr: str, *args: str) -> str:
    """`agg(expr, *args)` over the rows where `expr` is finite, e.g. `finite("avg", "loss")`."""
    call = ", ".join((expr, *args))
    return f"{agg}({call}) FILTER (WHERE isfinite({expr}))"


def nonfinite_count(columns: tuple[str, ...] | list[str]) -> str:
    """An aggregate: how many NaN or +-inf values `columns` hold (NULLs are not counted)."""
    return " + ".join(f"count(*) FILTER (WHERE NOT isfinite({c}))" for c in columns)
