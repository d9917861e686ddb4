"""Open a run for reading: DuckDB views over its live segments, or its compacted file."""

from __future__ import annotations

import contextlib
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trainspec.store.errors import StoreError, first_line
from trainspec.store.layout import (
    COMPACT_NAME,
    glob_literal,
    list_table_segments,
    parquet_path,
    segments_dir,
    sql_path,
)
from trainspec.store.tables import TABLES

_Key = tuple[str, int, int]  # (path, size, mtime): a file written again has a new key

# Most files a cache below remembers. A live run's small segments are merged away within
# minutes, but their keys stayed: a dashboard refreshing a 64-rank run every 2 s grew by
# about a million entries (330 bytes each) an hour. 65,536 keys are about 20 MB, far more than
# the files of the runs one process reads at once; a key pushed out is checked again.
CACHE_LIMIT = 1 << 16


class _Bounded(OrderedDict[_Key, str | None]):
    """A dict that forgets its oldest keys past `CACHE_LIMIT` (a dashboard's threads share
    it: the eviction holds a lock). An OrderedDict: a plain dict's first key is found by
    scanning past the slots of keys deleted before it, 40-80 us an insert once full."""

    _lock = threading.Lock()

    def __setitem__(self, key: _Key, value: str | None) -> None:
        with self._lock:
            super().__setitem__(key, value)
            while len(self) > CACHE_LIMIT:
                self.popitem(last=False)


# Footers read and schemas compared: None if the file may be read, else why not. Refreshing a
# live view re-checks only new files.
_checked: dict[_Key, str | None] = _Bounded()
# Files read through after a read failed (`_locate_damage`): None for one that read whole,
# else the damage. A damaged file is left out of every later view in this process up front.
_read_through: dict[_Key, str | None] = _Bounded()

_T = TypeVar("_T")

SQL_TYPES = {"double": "DOUBLE", "int32": "INTEGER", "int64": "BIGINT", "string": "VARCHAR"}


def sql_type(arrow_type: pa.DataType) -> str:
    """The DuckDB type a column of the store's schemas (`TABLES`) is stored as."""
    return SQL_TYPES[str(arrow_type)]


@dataclass
class RunSnapshot:
    """The files behind one set of views, and the segments skipped as unreadable."""

    run_dir: Path
    files: dict[str, list[Path]] = field(default_factory=dict)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _key(path: Path) -> _Key:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def _casts_safely(got: pa.DataType, want: pa.DataType) -> bool:
    """Whether every value of a `got` column is a `want` value, unchanged (or close: an
    integer as a double). A segment's column of another type (text for a time, a 64-bit
    rank) would widen the table's column for every segment read beside it."""
    if pa.types.is_dictionary(got):
        got = got.value_type
    if got == want or pa.types.is_null(got):
        return True
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or pa.types.is_integer(got)
    if pa.types.is_integer(want):
        if not pa.types.is_integer(got):
            return False
        if pa.types.is_signed_integer(got):
            return got.bit_width <= want.bit_width
        return got.bit_width < want.bit_width  # an unsigned value needs a wider signed column
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    return False


def _schema_problem(table: str, found: pa.Schema) -> str | None:
    """None if a segment of `found` columns reads as `table` rows; else what does not match."""
    for want in TABLES[table]:
        i = found.get_field_index(want.name)
        if i < 0:
            twice = len(found.get_all_field_indices(want.name)) > 1
            return f"not a {table} segment: column {want.name!r} " + (
                "appears twice" if twice else "is missing"
            )
        got = found.field(i).type
        if not _casts_safely(got, want.type):
            return f"not a {table} segment: column {want.name!r} is {got}, not {want.type}"
    return None


def segment_problem(path: Path, table: str, *, cache: bool = True) -> str | None:
    """None if the Parquet footer reads and its columns are `table`'s; else the reason
    (truncated, not Parquet, wrong columns, not a regular file...); "vanished" for a file
    a merge removed after the listing."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            return "a symbolic link to a file that does not exist"
        return "vanished"
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read for ever
        return "not a regular file"
    key = (str(path), st.st_size, st.st_mtime_ns)
    damage = _read_through.get(key)
    if damage:
        return damage
    if key in _checked:
        return _checked[key]
    try:
        found = pq.read_metadata(path).schema.to_arrow_schema()
    except Exception as exc:  # pyarrow raises several types for a bad footer
        if not path.exists():
            return "vanished"  # merged away between the stat and the read
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    reason = _schema_problem(table, found)
    if cache:
        _checked[key] = reason
    return reason


def _snapshot_once(run_dir: Path) -> tuple[RunSnapshot, bool]:
    snap = RunSnapshot(run_dir)
    vanished = False
    for table in TABLES:
        good: list[Path] = []
        where = segments_dir(run_dir, table)
        if where.exists() and not where.is_dir():  # was read as a table with no rows
            snap.skipped.append((where, "not a directory: this table's segments are missing"))
        for seg in list_table_segments(run_dir, table):
            reason = segment_problem(seg.path, table)
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


def segments_select(table: str, files: list[Path]) -> str:
    """A SELECT of `table`'s rows in `files` (one or more), by column name, each column cast
    to the store's type: files whose columns differ in order, width or extras read alike."""
    listing = ", ".join(parquet_path(p) for p in files)
    cols = ", ".join(f'CAST("{f.name}" AS {sql_type(f.type)}) AS "{f.name}"' for f in TABLES[table])
    return f"SELECT {cols} FROM read_parquet([{listing}], union_by_name=true)"


def _segments_sql(con: duckdb.DuckDBPyConnection, table: str, files: list[Path]) -> str:
    """A SELECT of `table`'s rows in `files` (in the table's column order and types)."""
    schema = TABLES[table]
    if files:
        return segments_select(table, files)
    cols = ", ".join(f'"{f.name}"' for f in schema)
    con.register(f"_empty_{table}", schema.empty_table())
    return f"SELECT {cols} FROM _empty_{table}"


def _create_views(con: duckdb.DuckDBPyConnection, snap: RunSnapshot, *, exact: bool) -> None:
    base = _attach_base(con, snap)
    for table in TABLES:
        segments = _segments_sql(con, table, snap.files.get(table, []))
        if base and (exact or not _covered(con, table, segments, base[table])):
            # Rows of the compacted file that no segment holds (their segments deleted, or
            # the run id reused by a later job): the segments' rows, then those.
            sql = (
                f"CREATE OR REPLACE VIEW {table} AS WITH seg AS ({segments}) "
                f"SELECT * FROM seg UNION ALL ({base[table]} EXCEPT ALL SELECT * FROM seg)"
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


def open_run(run: str | Path, *, exact: bool = False) -> Any:
    """A DuckDB connection with views `samples`, `steps`, `events`, `runs` over `run`.

    `run` is a run directory (read live, while writers append) or a compacted `run.duckdb`.
    Call `refresh(con)` to pick up segments written since. A directory holding both
    segments and a `run.duckdb` reads the segments plus the compacted rows no segment
    holds; `exact=True` (compaction) compares every row rather than each rank's count and
    time span (`_covered`). For a run directory the connection is a `RunConnection`: a
    statement that fails on a damaged file runs again without it.
    """
    path, compacted = resolve_run(run)
    if compacted:
        try:
            con = duckdb.connect(str(path), read_only=True)
        except duckdb.Error as exc:
            raise StoreError(f"{path}: cannot open: {first_line(exc)}") from exc
        con.execute("CREATE TEMP TABLE _skipped_segments (path VARCHAR, reason VARCHAR)")
        return con
    con = duckdb.connect(":memory:")
    try:
        snap = _list_and_create_views(con, path, exact=exact)
    except duckdb.Error as exc:  # damage no file could be blamed for
        con.close()
        raise StoreError(f"{path}: cannot read: {first_line(exc)}") from exc
    return RunConnection(con, path, exact=exact, snap=snap)


class RunConnection:
    """A live run's DuckDB connection (`open_run` of a run directory); anything not here is
    the DuckDB connection's own.

    A statement that fails on a file damaged behind a readable footer (a Parquet page or a
    `run.duckdb` block overwritten or cut short) runs again without that file: each file
    not yet read through in this process is read through once, on that error path only,
    and the damaged ones are listed in `skipped_segments` and left out of the views. A
    statement that fails because a merge removed a listed segment runs again on a fresh
    listing. Statements are retried whole, so only run ones that change nothing but temp
    tables, or that DuckDB rolls back when they fail (one INSERT, one CREATE TABLE AS).

    Only `execute` is retried, and only for what fails while it runs: a statement whose rows
    are fetched later in pieces (`fetchmany`, a streaming `.df()`), and `sql`, `table` or
    `query` (the connection's own), can still fail on a damaged or merged-away file.
    `fetch_arrow` reads a whole result under the retry. `raw` is the DuckDB connection,
    for callers that need one (`duckdb.sql(..., connection=)`, pandas, polars).
    """

    def __init__(
        self, con: duckdb.DuckDBPyConnection, run_dir: Path, *, exact: bool, snap: RunSnapshot
    ) -> None:
        self._con = con
        self.run_dir = run_dir
        self._exact = exact
        self._snap = snap

    @property
    def raw(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection itself (statements on it are not retried)."""
        return self._con

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> duckdb.DuckDBPyConnection:
        return self.retrying(lambda: self._con.execute(query, *args, **kwargs))

    def retrying(self, call: Callable[[], _T], attempts: int = 10) -> _T:
        """`call()`; after a failure on damaged data or a merged-away segment, leave the
        damaged files out (or list again) and call it again, `attempts` times at most."""
        for attempt in range(attempts):
            try:
                return call()
            except duckdb.Error as exc:
                if attempt == attempts - 1 or not _recoverable(self._con, self._snap, exc, attempt):
                    raise
                self.relist()
        raise AssertionError("unreachable")

    def relist(self) -> None:
        """List the run's files again and rebuild the views over them."""
        self._snap = _list_and_create_views(self._con, self.run_dir, exact=self._exact)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> RunConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        if name == "_con":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._con, name)


BASE = "_compacted"  # the run's run.duckdb, attached beside its segments
_TIME = {"samples": "ts", "steps": "ts", "events": "ts", "runs": "started_at"}


class _NotAStore(Exception):
    """An attached run.duckdb that lacks a table or column of the store's."""


def _base_select(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """A SELECT of the compacted file's `table` in the store's column order and types. A
    column stored as another type (a compaction that widened it to text) is cast back;
    a value that is no longer a number reads as NULL."""
    have = dict(
        con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() "
            "WHERE database_name = ? AND schema_name = 'main' AND table_name = ?",
            [BASE, table],
        ).fetchall()
    )
    if not have:
        raise _NotAStore(f"not a trainspec {COMPACT_NAME}: no table {table}")
    cols = []
    for f in TABLES[table]:
        want = sql_type(f.type)
        if f.name not in have:
            raise _NotAStore(f"not a trainspec {COMPACT_NAME}: {table} has no column {f.name}")
        same = have[f.name] == want
        cols.append(f'"{f.name}"' if same else f'TRY_CAST("{f.name}" AS {want}) AS "{f.name}"')
    return f"SELECT {', '.join(cols)} FROM {BASE}.{table}"


def _attached(con: duckdb.DuckDBPyConnection) -> bool:
    sql = "SELECT count(*) FROM duckdb_databases() WHERE database_name = ?"
    return bool(con.execute(sql, [BASE]).fetchall()[0][0])


def _attach_base(con: duckdb.DuckDBPyConnection, snap: RunSnapshot) -> dict[str, str] | None:
    """Attach the run's compacted file (if any) read-only beside its segments; a SELECT of
    each of its tables. One that cannot be opened, or found damaged by an earlier read
    (`_locate_damage`), is listed with the skipped segments: its rows are not in the view."""
    path = snap.run_dir / COMPACT_NAME
    attached = _attached(con)
    if not attached:
        if not path.is_file():
            return None
        with contextlib.suppress(OSError):
            damage = _read_through.get(_key(path))
            if damage:
                snap.skipped.append((path, damage))
                return None
    try:
        if not attached:
            con.execute(f"ATTACH {sql_path(path)} AS {BASE} (READ_ONLY)")
            for table in TABLES:  # a file from another tool, or damaged: its tables must read
                con.execute(f"SELECT count(*) FROM {BASE}.{table}").fetchall()
        return {table: _base_select(con, table) for table in TABLES}
    except (duckdb.Error, _NotAStore) as exc:
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DETACH {BASE}")
        snap.skipped.append((path, first_line(exc)))
        return None


def _covered(
    con: duckdb.DuckDBPyConnection, table: str, segments: str, base: str | None = None
) -> bool:
    """Whether the segments hold every row of the compacted file's `table` (`base`, a
    SELECT of it; by default as stored): per rank, the
    segments' rows inside the compacted rows' time span are as many, and their row hashes
    sum to the same. A compaction keeps its segments, so that is the usual case, and the
    view then reads the segments alone; a later job on the same run id, or segments deleted
    or replaced (even by as many rows), fail it, and the view adds the compacted rows the
    segments lack (exactly, `_create_views`). Rows the segments hold past the span (the job
    wrote on after compaction) are not compared: they are read from the segments anyway."""
    t = _TIME[table]
    b_cols = ", ".join(f'"{f.name}"' for f in TABLES[table])
    s_cols = ", ".join(f'seg."{f.name}"' for f in TABLES[table])
    base = base or f"SELECT {b_cols} FROM {BASE}.{table}"
    sql = (
        f"WITH b AS (SELECT rank, count(*) AS n, sum(hash({b_cols})::HUGEINT) AS h, "
        f"min({t}) AS lo, max({t}) AS hi FROM ({base}) b0 GROUP BY rank), "
        f"s AS (SELECT b.rank, count(*) AS n, sum(hash({s_cols})::HUGEINT) AS h "
        f"FROM b JOIN ({segments}) seg ON seg.rank IS NOT DISTINCT FROM b.rank "
        f"AND seg.{t} BETWEEN b.lo AND b.hi GROUP BY b.rank) "
        "SELECT count(*) FROM b LEFT JOIN s ON b.rank IS NOT DISTINCT FROM s.rank "
        "WHERE s.n IS NULL OR s.n <> b.n OR s.h <> b.h"
    )
    return con.execute(sql).fetchall()[0][0] == 0


# Errors a damaged file gives (DuckDB raises its plain Error for a bad Thrift header); not
# the statement's own (parser, binder, catalog, conversion) nor an interrupt. Invalid input
# and out-of-range errors are also what a query's own mistakes raise (malformed JSON, an
# integer overflow): those count only when they speak of a file, so a failing query is not
# answered by reading the whole run.
_DAMAGE_ERRORS = (duckdb.IOException, duckdb.InternalException, duckdb.SerializationException)
_FILE_WORDS = ("parquet", "file", ".duckdb", "thrift")
# Failures of the moment, not of the file: never remembered as damage.
_PASSING = ("too many open files", "permission denied", "resource temporarily unavailable",
            "cannot allocate memory", "interrupted", "conflicting lock",
            "could not set lock")  # fmt: skip


def is_passing_failure(message: str) -> bool:
    """Whether an error says the file cannot be read now (a lock another process holds, no
    file descriptors left), not that it is damaged."""
    text = message.lower()
    return any(word in text for word in _PASSING)


def _may_be_damage(exc: duckdb.Error) -> bool:
    if type(exc) is duckdb.Error or isinstance(exc, _DAMAGE_ERRORS):
        return True
    if isinstance(exc, (duckdb.InvalidInputException, duckdb.OutOfRangeException)):
        text = str(exc).lower()
        return any(word in text for word in _FILE_WORDS)
    return False


def _damage_reason(con: duckdb.DuckDBPyConnection, source: str) -> str | None:
    """Why `source` cannot be read through, or None when it can. A failure is damage only
    if a second read fails the same way and it is not one of the moment (a process out of
    file descriptors, a permission): that is remembered for the life of the process."""
    try:
        _read_through_ok(con, source)
        return None
    except duckdb.Error as first:
        if not _may_be_damage(first):
            raise
        message = first_line(first)
    if is_passing_failure(message):
        raise duckdb.IOException(message)
    try:
        _read_through_ok(con, source)
    except duckdb.Error as second:
        if first_line(second) == message:
            return f"damaged: {message}"
        raise
    return None


def _vanished(snap: RunSnapshot) -> bool:
    return any(not p.exists() for files in snap.files.values() for p in files)


def _read_through_ok(con: duckdb.DuckDBPyConnection, source: str) -> None:
    """Read every column of every row of `source`, in constant memory."""
    con.execute(f"SELECT count(*), bit_xor(hash(t)) FROM {source} t").fetchall()


def _locate_damage(con: duckdb.DuckDBPyConnection, snap: RunSnapshot) -> list[Path]:
    """The files behind the views that cannot be read through (each read once in this
    process, then remembered in `_read_through`): the compacted file is detached, and the
    next listing leaves them out and names them."""
    found: list[Path] = []
    base = snap.run_dir / COMPACT_NAME
    if _attached(con):
        for table in TABLES:
            reason = _damage_reason(con, f"{BASE}.{table}")
            if reason is not None:
                with contextlib.suppress(duckdb.Error):
                    con.execute(f"DETACH {BASE}")
                with contextlib.suppress(OSError):
                    _read_through[_key(base)] = reason
                    found.append(base)
                break
    for files in snap.files.values():
        for path in files:
            try:
                key = _key(path)
            except OSError:
                continue  # merged away since: the next listing has its rows
            if key in _read_through:
                continue
            try:
                reason = _damage_reason(con, f"read_parquet([{parquet_path(path)}])")
            except duckdb.Error:
                if not path.exists():
                    continue  # merged away since: the next listing has its rows
                raise
            _read_through[key] = reason
            if reason is not None:
                found.append(path)
    return found


def _recoverable(
    con: duckdb.DuckDBPyConnection, snap: RunSnapshot, exc: duckdb.Error, attempt: int
) -> bool:
    """Whether a statement that failed with `exc` over `snap`'s files may succeed on a new
    listing: a listed segment was merged away, or damaged files were found (and will be
    left out)."""
    if not _may_be_damage(exc):
        return False
    if _vanished(snap):
        # A writer merging every few writes can delete a file between our listing and the
        # read more than once in a row; back off briefly and list again.
        time.sleep(0.002 * (attempt + 1))
        return True
    return bool(_locate_damage(con, snap))


def _list_and_create_views(
    con: duckdb.DuckDBPyConnection, path: Path, attempts: int = 10, *, exact: bool = False
) -> RunSnapshot:
    # DuckDB reads each file's schema when the view is created (and, beside a compacted
    # file, the segments' rows, `_covered`), so a merge that deletes a listed file between
    # listing and CREATE VIEW, or a damaged file, fails it: list again and retry.
    for attempt in range(attempts):
        snap = snapshot(path)
        try:
            _create_views(con, snap, exact=exact)
            return snap
        except duckdb.Error as exc:
            if attempt == attempts - 1 or not _recoverable(con, snap, exc, attempt):
                raise
    raise AssertionError("unreachable")


def refresh(con: Any) -> None:
    """Re-list the segments behind a live connection's views (no-op for a compacted run)."""
    if isinstance(con, RunConnection):
        con.relist()


def skipped_segments(con: Any) -> list[tuple[str, str]]:
    """Segments left out of the views as unreadable: (path, reason)."""
    return [tuple(r) for r in con.execute("SELECT * FROM _skipped_segments").fetchall()]


def fetch_arrow(con: Any, sql: str) -> pa.Table:
    """`sql`'s result as an Arrow table, on DuckDB 1.x (fetch_arrow_table) and 2.x; over a
    `RunConnection`, retried without damaged files as its statements are."""
    if isinstance(con, RunConnection):
        return con.retrying(lambda: _fetch_arrow(con.raw, sql))
    return _fetch_arrow(con, sql)


def _fetch_arrow(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    relation = con.sql(sql)
    if relation is None:  # a statement with no result (SET, CREATE ...)
        return pa.table({})
    method = getattr(relation, "to_arrow_table", None) or relation.fetch_arrow_table
    return method()


def unreadable_segments(run: str | Path) -> list[tuple[str, str]]:
    """Segments a reader of `run` leaves out as unreadable now: (path, reason); none for a
    compacted file given as the run. The run's own `run.duckdb` is listed when a read in
    this process found it damaged. For a caller that reads through something else's
    connection."""
    path, compacted = resolve_run(run)
    if compacted:
        return []
    skipped = [(str(p), r) for p, r in snapshot(path).skipped]
    base = path / COMPACT_NAME
    with contextlib.suppress(OSError):  # the compacted file, found damaged by a read here
        damage = _read_through.get(_key(base)) if base.is_file() else None
        if damage:
            skipped.append((str(base), damage))
    return skipped


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


def _confine(con: duckdb.DuckDBPyConnection, run: str | Path) -> None:
    """From here on the connection reads the run's own files only: a SELECT can read any file
    the user can (`read_text('/etc/...')`, `glob('/root/*')`, `read_csv`), and
    `trainspec query` runs the SQL it is given, which may come from somewhere less trusted
    than its caller (a dashboard field, a CI step). DuckDB's `allowed_directories` with
    external access off keeps the run's directory readable (a relisting after a merge reads
    the new segments), and the configuration is locked so the SQL cannot undo it."""
    path, compacted = resolve_run(run)
    root = path.parent if compacted else path
    # DuckDB checks the path as the SQL names it: segments are named by glob patterns that
    # match only themselves (`glob_literal`: a run under `runs/exp*` reads `runs/exp[*]/...`)
    roots = {form for r in (root.absolute(), root.resolve()) for form in (r, glob_literal(r))}
    dirs = sorted(str(r).rstrip("/") + "/" for r in roots)
    con.execute("SET allowed_directories = $dirs", {"dirs": dirs})
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def query_with_skipped(
    run: str | Path, sql: str, *, attempts: int = 10
) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Run `sql` against a run: the result as a pyarrow Table, and the segments left out of
    it as unreadable, (path, reason), so a caller can say the answer lacks their rows.

    A merge may delete a segment between listing and reading; the query is retried on a
    fresh listing, so a live reader never fails on a merge in flight. A file damaged behind
    a readable footer is found when the query fails on it, and left out (and listed). Only SELECT
    statements run: StoreError for any other, which could change the run (a DELETE through
    ATTACH, a COPY over a segment's name, an EXPLAIN ANALYZE of either).
    """
    _check_read_only(sql)
    con = open_run(run)
    try:
        _confine(con.raw if isinstance(con, RunConnection) else con, run)
        if isinstance(con, RunConnection):
            table = con.retrying(lambda: _fetch_arrow(con.raw, sql), attempts=attempts)
        else:
            table = _fetch_arrow(con, sql)
        return table, skipped_segments(con)
    finally:
        con.close()
