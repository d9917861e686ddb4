"""Fold a run's segments into one `run.duckdb` beside them."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from trainspec.store.errors import StoreError, first_line
from trainspec.store.journal import Salvaged, salvage_run
from trainspec.store.layout import COMPACT_NAME, sql_path
from trainspec.store.reader import (
    is_passing_failure,
    open_run,
    resolve_run,
    skipped_segments,
    sql_type,
)
from trainspec.store.segments import sync_path
from trainspec.store.tables import TABLES

log = logging.getLogger("trainspec.store")


@dataclass
class Compaction:
    """What a compaction did: the file written, the files left out as unreadable (their
    rows are not in it; the files are kept), and where a damaged `run.duckdb` it replaced
    was moved (kept for the user, never deleted)."""

    target: Path
    skipped: list[tuple[str, str]] = field(default_factory=list)
    set_aside: Path | None = None
    salvaged: Salvaged = field(default_factory=Salvaged)


def compact(run: str | Path, *, skip_unreadable: bool = False) -> Path:
    """Write `run.duckdb` from the run's segments; idempotent; the segments are kept.

    The file is built under a temporary name and renamed, so a reader sees the old file or
    the new one, never half of one. A segment that cannot be read stops the compaction
    (StoreError naming it): the new file would lack its rows and replace an older
    `run.duckdb` that may still hold them. `skip_unreadable=True` compacts without them.
    An already compacted file is read through to check it is whole. A `run.duckdb` already
    beside the segments is folded in: the new file holds its rows that no segment holds.
    """
    return compact_run(run, skip_unreadable=skip_unreadable).target


def compact_run(run: str | Path, *, skip_unreadable: bool = False) -> Compaction:
    """`compact`, saying what it left out (see `Compaction`)."""
    path, compacted = resolve_run(run)
    if compacted:
        _check_readable(path)
        return Compaction(path)  # already a compacted file and no segments to fold
    with _exclusive(path):
        # Rows killed processes journaled and never flushed go into segments first.
        salvaged = salvage_run(path)
        done = _compact_locked(path, skip_unreadable=skip_unreadable)
        done.salvaged = salvaged
        return done


LOCK_NAME = ".compact.lock"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One compaction of a run at a time (an advisory lock on a file in the run): a second
    would build its file beside the first's and one would rename a half-written file over
    the other's. StoreError at once if another compaction holds it."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"{path}: cannot compact: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"{path}: another compaction of this run is running") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_skipped(path: Path, skipped: list[tuple[str, str]]) -> None:
    if skipped:
        where, why = skipped[0]
        more = f" and {len(skipped) - 1} more" if len(skipped) > 1 else ""
        raise StoreError(
            f"{path}: not compacted: segment {where} cannot be read ({why}){more}; "
            "the compacted file would lack its rows (--skip-unreadable to compact anyway)"
        )


def _set_aside(target: Path) -> Path | None:
    """Move a damaged `run.duckdb` out of the new one's way (kept for the user: rows no
    segment holds may be recoverable from it). An empty file holds nothing: replaced."""
    try:
        if target.stat().st_size == 0:
            return None
    except FileNotFoundError:
        return None
    n = 1
    while True:
        aside = target.with_name(f"{COMPACT_NAME}.damaged" + (f"-{n}" if n > 1 else ""))
        if not aside.exists() and not aside.is_symlink():
            break
        n += 1
    os.rename(target, aside)  # under the compaction lock: nobody else names files here
    return aside


def _compact_locked(path: Path, *, skip_unreadable: bool) -> Compaction:
    target = path / COMPACT_NAME
    # Compactions interrupted earlier, with DuckDB's write-ahead logs (`.tmp.wal`).
    for stale in path.glob(f".{COMPACT_NAME}.*.tmp*"):
        with contextlib.suppress(OSError):
            stale.unlink()
    tmp = path / f".{COMPACT_NAME}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    # DuckDB cuts a database path at '?' to name its write-ahead log ("r?/x" -> "r.wal?/x"),
    # so under such a path the file is built in a temporary directory and copied in.
    build_dir = Path(tempfile.mkdtemp(prefix="trainspec-compact-")) if "?" in str(tmp) else None
    build = build_dir / COMPACT_NAME if build_dir is not None else tmp
    # An older run.duckdb beside the segments is folded in: its rows that no segment holds
    # (a later job on the same run id, segments deleted) would otherwise be replaced away.
    con = open_run(path, exact=True)
    try:
        if not skip_unreadable:  # refused before any writing, where the footers tell
            _refuse_skipped(path, skipped_segments(con))
        con.raw.execute(f"ATTACH {sql_path(build)} AS out")
        for table, schema in TABLES.items():
            # The store's own column types, whatever a segment or an older file held.
            columns = ", ".join(f'"{f.name}" {sql_type(f.type)}' for f in schema)
            con.raw.execute(f"CREATE TABLE out.{table} ({columns})")
            names = ", ".join(f'"{f.name}"' for f in schema)
            order = "rank, ts" if table != "runs" else "rank"
            # Retried on a new listing when a rank merged segments away since the listing
            # (a live run), or without a file found damaged; a failed INSERT is rolled back.
            con.execute(f"INSERT INTO out.{table} SELECT {names} FROM {table} ORDER BY {order}")
        skipped = skipped_segments(con)
        if not skip_unreadable:  # damage found while reading the rows
            _refuse_skipped(path, skipped)
        con.raw.execute("DETACH out")
        con.close()
        if build != tmp:
            shutil.copyfile(build, tmp)
            sync_path(tmp)
        set_aside = None
        reason = next((why for where, why in skipped if where == str(target)), None)
        if reason is not None:
            if is_passing_failure(reason):  # locked by another process, out of descriptors
                raise StoreError(f"{path}: not compacted: {target} cannot be read now "
                                 f"({reason}); it is not damaged, try again")  # fmt: skip
            set_aside = _set_aside(target)
        os.replace(tmp, target)
    except (duckdb.Error, OSError) as exc:
        reason = first_line(exc)
        raise StoreError(f"{path}: compaction failed: {reason}{_free_space(path)}") from exc
    finally:
        con.close()
        # Whatever stopped the compaction (an error, Ctrl-C), the old run.duckdb and the
        # segments are untouched; only the half-written file goes. One that cannot be
        # removed is left for the next compaction to replace. The segments are never
        # removed, the ones left out as unreadable included.
        for left in (tmp, tmp.with_name(tmp.name + ".wal")):
            with contextlib.suppress(OSError):
                left.unlink(missing_ok=True)
        if build_dir is not None:
            shutil.rmtree(build_dir, ignore_errors=True)
    try:  # the new name as lasting as the file DuckDB synced at DETACH
        sync_path(path)
    except OSError as exc:  # compacted all the same: said, not a failed compaction
        log.warning("trainspec: %s is compacted, but fsync of the directory failed (a host "
                    "crash may lose the new name): %s", target, exc)  # fmt: skip
    return Compaction(target, skipped, set_aside)


def _free_space(path: Path) -> str:
    """`; N KiB free on this file system` when that is little (DuckDB says "CHECKPOINT
    during DETACH failed", not that the disk is full), else ''."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; only {free // 1024} KiB free on its file system" if free < 64 << 20 else ""


def _check_readable(path: Path) -> None:
    """Read every table of a compacted file through; StoreError naming the damage. Opening
    alone reads only the header, so a file cut short or overwritten in the middle opened."""
    con = open_run(path)
    try:
        for table in TABLES:  # every column of every row, in constant memory
            con.execute(f"SELECT count(*), bit_xor(hash(t)) FROM {table} t").fetchall()
    except duckdb.Error as exc:
        reason = first_line(exc)
        raise StoreError(f"{path}: damaged: {reason}") from exc
    finally:
        con.close()
