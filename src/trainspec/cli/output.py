"""Printing Arrow tables for people (aligned text) and programs (CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import math

import pyarrow as pa


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.6g}"
    return str(value)


def render_text(table: pa.Table, max_rows: int = 200) -> str:
    cols = table.column_names
    rows = [[_cell(v) for v in row.values()] for row in table.slice(0, max_rows).to_pylist()]
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
    for row in table.to_pylist():
        writer.writerow([_cell(v) for v in row.values()])
    return buf.getvalue()


def render_json(table: pa.Table) -> str:
    def clean(v: object) -> object:
        return None if isinstance(v, float) and math.isnan(v) else v

    return json.dumps([{k: clean(v) for k, v in r.items()} for r in table.to_pylist()], indent=1)
