"""Printing Arrow tables for people (aligned text) and programs (CSV, JSON)."""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import math
import sys
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from trainspec import strict_json

# From here up, `%g` would round away the decimals (or write 1.79556e+09 for an epoch-seconds
# timestamp): such floats are written in full with milliseconds. Past the upper bound a double
# holds no milliseconds, and the exponent form is the honest one.
FIXED_FROM, FIXED_BELOW = 1e5, 1e15


def _cell(value: object) -> str:
    """A value for the aligned table: small floats to 6 significant digits, large ones
    (timestamps, byte counts) with every integer digit and milliseconds."""
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if FIXED_FROM <= abs(value) < FIXED_BELOW:
            return f"{value:.0f}" if value.is_integer() else f"{value:.3f}"
        return f"{value:.6g}"
    return str(value)


def _csv_cell(value: object) -> str:
    """A value for programs: a float as Python writes it (the shortest text that reads back
    as the same double), so nothing is rounded away."""
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _rows(table: pa.Table) -> list[tuple]:
    """Rows by position: `SELECT 1 AS a, 2 AS a` has two columns named `a`, which rows as
    dicts (`to_pylist`) would fold into one."""
    return list(zip(*(column.to_pylist() for column in table.columns)))


def render_text(table: pa.Table, max_rows: int = 200) -> str:
    cols = table.column_names
    rows = [[_cell(v) for v in row] for row in _rows(table.slice(0, max_rows))]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if table.num_rows > max_rows:
        lines.append(f"... {table.num_rows - max_rows} more rows (use --csv or --json for all)")
    return "\n".join(lines)


def render_csv(table: pa.Table) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(table.column_names)
    for row in _rows(table):
        writer.writerow([_csv_cell(v) for v in row])
    return buf.getvalue()


def _json_value(value: object) -> object:
    """What json cannot write by itself: `sum(tokens)` is a DuckDB HUGEINT (a Decimal),
    `to_timestamp(ts)` a datetime, `uuid()` a UUID, a BLOB bytes."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def render_json(table: pa.Table) -> str:
    keys = _unique_names(table.column_names)
    rows = [dict(zip(keys, row)) for row in _rows(table)]
    return strict_json.dumps(rows, indent=1, default=_json_value)


def _unique_names(names: list[str]) -> list[str]:
    """JSON objects cannot repeat a key: a second `a` becomes `a_2`, a third `a_3`."""
    seen: dict[str, int] = {}
    taken = set(names)
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        key, n = name, seen[name]
        while n > 1 and (key := f"{name}_{n}") in taken:
            n += 1
        taken.add(key)
        out.append(key)
    return out


def warn_skipped(command: str, skipped: Iterable[tuple[str, str]]) -> None:
    """One stderr line per segment a command's answer left out as unreadable: the answer
    stands (exit 0) for the rows that could be read, and the reader knows what it lacks."""
    skipped = list(skipped)
    damaged = {Path(path) for path, _ in skipped}
    for path, reason in skipped:
        print(
            f"trainspec {command}: warning: skipped unreadable segment {path} ({reason}); "
            f"{_what_is_missing(Path(path), damaged)}",
            file=sys.stderr,
        )


def _what_is_missing(path: Path, damaged: set[Path]) -> str:
    """A segment's rows are in the answer anyway where a readable run.duckdb beside it holds
    them (a compaction folded it in): the readers add the compacted rows no segment holds."""
    from trainspec.store.layout import COMPACT_NAME, run_dir_of

    run_dir = run_dir_of(path)
    base = run_dir / COMPACT_NAME if run_dir is not None else None
    if base is not None and base.is_file() and base not in damaged:
        return f"its rows are missing from the result unless {base.name} holds them"
    return "its rows are missing from the result"
