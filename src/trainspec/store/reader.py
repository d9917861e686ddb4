"""Open a run for reading: DuckDB views over its live segments, or its compacted file."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trainspec.store.errors import StoreError
from trainspec.store.layout import COMPACT_NAME, list_table_segments, sql_path
from trainspec.store.tables import TABLES

# Validated footers, keyed by (path, size, mtime): refreshing a live view re-checks only new files.
_checked: dict[tuple[str, int, int], bool] = {}


@dataclass
class RunSnapshot:
    """The files behind one set of views, and the segments skipped as unreadable."""

    run_dir: Path
    files: dict[str, list[Path]] = field(default_factory=dict)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _readable(path: Path) -> str | None:
    """None if the Parquet footer reads; else the reason (truncated, not Parquet...)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "vanished"
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _checked:
        return None
    try:
        pq.read_metadata(path)
    except Exception as exc:  # pyarrow raises several types for a bad footer
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    _checked[key] = True
    return None


def _snapshot_once(run_dir: Path) -> tuple[RunSnapshot, bool]:
    snap = RunSnapshot(run_dir)
    vanished = False
    for table in TABLES:
        good: list[Path] = []
        for seg in list_table_segments(run_dir, table):
            reason = _readable(seg.path)
            if reason is None:
                good.append(seg.path)
            elif reason == "vanished":
                vanished = True
            else:
                snap.skipped.append((seg.path, reason))
        snap.files[table] = good
    return snap, vanished


def snapshot(run_dir: Path, *, attempts: int = 20) -> RunSnapshot:
    """The run's readable segments. A file that vanished between listing and checking was
    merged away: its rows are in a wider file the listing may have missed, so list again
    rather than return a view that is short of rows (a live count would go down)."""
    for _ in range(attempts):
        snap, vanished = _snapshot_once(run_dir)
        if not vanished:
            break
    return snap


def _segments_sql(con: duckdb.DuckDBPyConnection, table: str, files: list[Path]) -> str:
    """A SELECT of `table`'s rows in `files` (in the table's column order)."""
    schema = TABLES[table]
    cols = ", ".join(f'"{f.name}"' for f in schema)
    if files:
        listing = ", ".join(sql_path(p) for p in files)
        return f"SELECT {cols} FROM read_parquet([{listing}], union_by_name=true)"
    con.register(f"_empty_{table}", schema.empty_table())
    return f"SELECT {cols} FROM _empty_{table}"


def _create_views(con: duckdb.DuckDBPyConnection, snap: RunSnapshot, *, exact: bool) -> None:
    base = _attach_base(con, snap)
    for table in TABLES:
        segments = _segments_sql(con, table, snap.files.get(table, []))
        if base and (exact or not _covered(con, table, segments)):
            # Rows of the compacted file that no segment holds (their segments deleted, or
            # the run id reused by a later job): the segments' rows, then those.
            cols = ", ".join(f'"{f.name}"' for f in TABLES[table])
            sql = (
                f"CREATE OR REPLACE VIEW {table} AS WITH seg AS ({segments}) "
                f"SELECT * FROM seg UNION ALL "
                f"(SELECT {cols} FROM {BASE}.{table} EXCEPT ALL SELECT * FROM seg)"
            )
        else:
            sql = f"CREATE OR REPLACE VIEW {table} AS {segments}"
        con.execute(sql)
    con.execute("CREATE OR REPLACE TEMP TABLE _skipped_segments (path VARCHAR, reason VARCHAR)")
    if snap.skipped:
        con.executemany(
            "INSERT INTO _skipped_segments VALUES (?, ?)",
            [(str(p), r) for p, r in snap.skipped],
        )


def resolve_run(run: str | Path) -> tuple[Path, bool]:
    """(path, is_compacted_file). Raises StoreError naming what is wrong with `run`."""
    path = Path(run)
    if path.is_file():
        if path.suffix != ".duckdb":
            raise StoreError(f"{path}: not a run directory or a .duckdb file")
        return path, True
    if not path.is_dir():
        raise StoreError(f"{path}: no such run directory")
    if (path / "segments").is_dir():
        return path, False
    if (path / COMPACT_NAME).is_file():
        return path / COMPACT_NAME, True
    raise StoreError(f"{path}: not a trainspec run (no segments/ and no {COMPACT_NAME})")


def open_run(run: str | Path, *, exact: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with views `samples`, `steps`, `events`, `runs` over `run`.

    `run` is a run directory (read live, while writers append) or a compacted `run.duckdb`.
    Call `refresh(con)` to pick up segments written since. A directory holding both
    segments and a `run.duckdb` reads the segments plus the compacted rows no segment
    holds; `exact=True` (compaction) compares every row rather than each rank's count and
    time span (`_covered`).
    """
    path, compacted = resolve_run(run)
    if compacted:
        try:
            con = duckdb.connect(str(path), read_only=True)
        except duckdb.Error as exc:
            raise StoreError(f"{path}: cannot open: {str(exc).splitlines()[0]}") from exc
        con.execute("CREATE TEMP TABLE _skipped_segments (path VARCHAR, reason VARCHAR)")
        return con
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"SET VARIABLE trainspec_run_dir = {sql_path(path)}")
        con.execute(f"SET VARIABLE trainspec_exact = {bool(exact)}")
        _list_and_create_views(con, path, exact=exact)
    except duckdb.Error as exc:  # data damaged behind a readable footer, read to build views
        con.close()
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreError(f"{path}: cannot read: {reason}") from exc
    return con


BASE = "_compacted"  # the run's run.duckdb, attached beside its segments
_TIME = {"samples": "ts", "steps": "ts", "events": "ts", "runs": "started_at"}


def _attach_base(con: duckdb.DuckDBPyConnection, snap: RunSnapshot) -> bool:
    """Attach the run's compacted file (if any) read-only beside its segments. One that
    cannot be opened is listed with the skipped segments: its rows are not in the view."""
    if con.execute(
        "SELECT count(*) FROM duckdb_databases() WHERE database_name = ?", [BASE]
    ).fetchall()[0][0]:
        return True
    path = snap.run_dir / COMPACT_NAME
    if not path.is_file():
        return False
    try:
        con.execute(f"ATTACH {sql_path(path)} AS {BASE} (READ_ONLY)")
        for table in TABLES:  # a file from another tool, or damaged: its tables must read
            con.execute(f"SELECT count(*) FROM {BASE}.{table}").fetchall()
    except duckdb.Error as exc:
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DETACH {BASE}")
        snap.skipped.append((path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
        return False
    return True


def _covered(con: duckdb.DuckDBPyConnection, table: str, segments: str) -> bool:
    """Whether the segments hold every row of the compacted file's `table`: per rank, the
    segments' rows inside the compacted rows' time span are as many, and their row hashes
    sum to the same. A compaction keeps its segments, so that is the usual case, and the
    view then reads the segments alone; a later job on the same run id, or segments deleted
    or replaced (even by as many rows), fail it, and the view adds the compacted rows the
    segments lack (exactly, `_create_views`). Rows the segments hold past the span (the job
    wrote on after compaction) are not compared: they are read from the segments anyway."""
    t = _TIME[table]
    b_cols = ", ".join(f'"{f.name}"' for f in TABLES[table])
    s_cols = ", ".join(f'seg."{f.name}"' for f in TABLES[table])
    sql = (
        f"WITH b AS (SELECT rank, count(*) AS n, sum(hash({b_cols})::HUGEINT) AS h, "
        f"min({t}) AS lo, max({t}) AS hi FROM {BASE}.{table} GROUP BY rank), "
        f"s AS (SELECT b.rank, count(*) AS n, sum(hash({s_cols})::HUGEINT) AS h "
        f"FROM b JOIN ({segments}) seg ON seg.rank IS NOT DISTINCT FROM b.rank "
        f"AND seg.{t} BETWEEN b.lo AND b.hi GROUP BY b.rank) "
        "SELECT count(*) FROM b LEFT JOIN s ON b.rank IS NOT DISTINCT FROM s.rank "
        "WHERE s.n IS NULL OR s.n <> b.n OR s.h <> b.h"
    )
    return con.execute(sql).fetchall()[0][0] == 0


def _list_and_create_views(
    con: duckdb.DuckDBPyConnection, path: Path, attempts: int = 10, *, exact: bool = False
) -> None:
    # DuckDB reads each file's schema when the view is created, so a merge that deletes a
    # listed file between listing and CREATE VIEW fails it: list again and retry.
    for attempt in range(attempts):
        try:
            _create_views(con, snapshot(path), exact=exact)
            return
        except duckdb.IOException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.002 * (attempt + 1))


def refresh(con: duckdb.DuckDBPyConnection) -> None:
    """Re-list the segments behind a live connection's views (no-op for a compacted run)."""
    row = con.execute(
        "SELECT getvariable('trainspec_run_dir'), getvariable('trainspec_exact')"
    ).fetchall()[0]
    if row and row[0]:
        _list_and_create_views(con, Path(row[0]), exact=bool(row[1]))


def skipped_segments(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """Segments left out of the views as unreadable: (path, reason)."""
    return [tuple(r) for r in con.execute("SELECT * FROM _skipped_segments").fetchall()]


def fetch_arrow(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """`sql`'s result as an Arrow table, on DuckDB 1.x (fetch_arrow_table) and 2.x."""
    relation = con.sql(sql)
    if relation is None:  # a statement with no result (SET, CREATE ...)
        return pa.table({})
    method = getattr(relation, "to_arrow_table", None) or relation.fetch_arrow_table
    return method()


def unreadable_segments(run: str | Path) -> list[tuple[str, str]]:
    """Segments a reader of `run` leaves out as unreadable now: (path, reason); none for a
    compacted file. For a caller that reads through something else's connection."""
    path, compacted = resolve_run(run)
    return [] if compacted else [(str(p), r) for p, r in snapshot(path).skipped]


def query(run: str | Path, sql: str, *, attempts: int = 10) -> pa.Table:
    """Run `sql` against a run and return a pyarrow Table (see `query_with_skipped`)."""
    return query_with_skipped(run, sql, attempts=attempts)[0]


# SELECT only: `EXPLAIN ANALYZE <statement>` runs the statement it explains.
_READ_ONLY_STATEMENTS = frozenset({"SELECT"})


def _check_read_only(sql: str) -> None:
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return  # not SQL DuckDB can parse: running it says why, as any bad query does
    for statement in statements:
        kind = getattr(statement.type, "name", str(statement.type))
        if kind not in _READ_ONLY_STATEMENTS:
            raise StoreError(
                f"only SELECT queries run against a run (it is read, never changed); "
                f"this is a {kind} statement"
            )


def query_with_skipped(
    run: str | Path, sql: str, *, attempts: int = 10
) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Run `sql` against a run: the result as a pyarrow Table, and the segments left out of
    it as unreadable, (path, reason), so a caller can say the answer lacks their rows.

    A merge may delete a segment between listing and reading; the query is retried on a
    fresh listing, so a live reader never fails on a merge in flight. Only SELECT
    statements run: StoreError for any other, which could change the run (a DELETE through
    ATTACH, a COPY over a segment's name, an EXPLAIN ANALYZE of either).
    """
    _check_read_only(sql)
    con = open_run(run)
    try:
        for attempt in range(attempts):
            try:
                return fetch_arrow(con, sql), skipped_segments(con)
            except duckdb.IOException:
                if attempt == attempts - 1:
                    raise
                # A writer merging every few writes can delete a file between our listing
                # and the read more than once in a row; back off briefly and re-list.
                time.sleep(0.002 * (attempt + 1))
                refresh(con)
    finally:
        con.close()
    raise StoreError("unreachable")
