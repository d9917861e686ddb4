"""Fold a run's segments into one `run.duckdb` beside them."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

from trainspec.store.errors import StoreError
from trainspec.store.layout import COMPACT_NAME
from trainspec.store.reader import open_run, resolve_run
from trainspec.store.tables import TABLES


def compact(run: str | Path) -> Path:
    """Write `run.duckdb` from the run's segments; idempotent; the segments are kept.

    The file is built under a temporary name and renamed, so a reader sees the old file or
    the new one, never half of one.
    """
    path, compacted = resolve_run(run)
    if compacted:
        return path  # already a compacted file and no segments to fold
    target = path / COMPACT_NAME
    tmp = path / f".{COMPACT_NAME}.tmp"
    tmp.unlink(missing_ok=True)
    con = open_run(path)
    try:
        con.execute(f"ATTACH '{tmp.as_posix()}' AS out")
        for table in TABLES:
            order = "rank, ts" if table != "runs" else "rank"
            con.execute(f"CREATE TABLE out.{table} AS SELECT * FROM {table} ORDER BY {order}")
        con.execute("DETACH out")
    except duckdb.Error as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"{path}: compaction failed: {str(exc).splitlines()[0]}") from exc
    finally:
        con.close()
    os.replace(tmp, target)
    return target
