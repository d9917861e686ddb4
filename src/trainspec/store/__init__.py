"""The run store: crash-safe Parquet segments written through DuckDB, read live through views.

Contract:
- `SegmentWriter(run_dir, table, writer_id)` appends immutable segments for one table and one
  writer (a rank, or a node's agent). Each segment is written under a temporary name and
  renamed, so a crash leaves whole segments or none. Small segments are merged into larger
  ones as the run goes on; a merged file's name carries the range it covers, and readers drop
  any file whose range another covers, so nobody sees a row twice or misses one mid-merge.
- `open(run)` returns a DuckDB connection with the views `samples`, `steps`, `events`, `runs`;
  it works while writers in other processes are still appending. Corrupt or truncated
  segments, segments whose columns are not the table's, and anything that is not a regular
  file are reported by name (`skipped_segments(con)`, `query_with_skipped`,
  `unreadable_segments(run)`) and left out. A file damaged behind a readable footer is found
  when a statement fails on it (each file is then read through once) and left out likewise.
- `compact(run)` folds the segments into one `run.duckdb` beside them, in the store's column
  types (segments are kept, unreadable ones included; `compact_run` says what it left out).
"""

from __future__ import annotations

from trainspec.store.compact import compact
from trainspec.store.errors import StoreError
from trainspec.store.reader import (
    fetch_arrow,
    query,
    query_with_skipped,
    refresh,
    skipped_segments,
    unreadable_segments,
)
from trainspec.store.reader import open_run as open
from trainspec.store.segments import SegmentWriter
from trainspec.store.tables import TABLES, empty_table

__all__ = [
    "TABLES",
    "SegmentWriter",
    "StoreError",
    "compact",
    "empty_table",
    "fetch_arrow",
    "refresh",
    "open",
    "query",
    "query_with_skipped",
    "skipped_segments",
    "unreadable_segments",
]
