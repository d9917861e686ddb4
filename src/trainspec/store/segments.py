"""SegmentWriter: append immutable Parquet segments for one table and one writer."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trainspec.store.errors import StoreError
from trainspec.store.layout import (
    SegmentFile,
    list_writer_segments,
    segment_name,
    segments_dir,
    sql_path,
)
from trainspec.store.reader import segment_problem, segments_select
from trainspec.store.tables import TABLES

MERGE_FANOUT = 16  # segments of one size class merged into one of the next
# Footer keys: every segment's own id, and a merge's inputs' ids (comma-separated). They
# tell a segment that another writer under the same id merged in from one it covers.
TOKEN_KEY = b"trainspec.segment"
INPUTS_KEY = b"trainspec.inputs"

log = logging.getLogger("trainspec.store")


class _NameTaken(Exception):
    """The segment's name exists already: another writer with the same id wrote it."""


def _claim(tmp: Path, final: Path) -> None:
    """Give the written file `tmp` the name `final` unless that name exists (a hard link
    fails then), so two writers under one id never replace each other's segment. Where the
    file system has no hard links, a rename, as before."""
    try:
        os.link(tmp, final)
    except FileExistsError as exc:
        raise _NameTaken(str(final)) from exc
    except OSError:  # EPERM, ENOTSUP, EXDEV: no hard links here
        os.replace(tmp, final)
        return
    with contextlib.suppress(OSError):  # named already: a leftover dot-file is never read
        os.unlink(tmp)


def sync_path(path: Path) -> None:
    """Make `path` (a file, or a directory's entries) durable: a rename or a link is only as
    lasting as the data and the directory entry behind it, and a merge deletes its inputs
    once its output is in place. Without this, a host crash just after a merge could leave
    the new name on an empty file and the older files gone (ext4 orders a rename over an
    existing name, not a rename to a new one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size_class(segment: SegmentFile, fanout: int) -> int:
    return int(math.log(segment.span, fanout) + 1e-9)


class SegmentWriter:
    """Writes one table's segments for one writer (`rank-3`, `agent-node1`).

    Each `write` produces one file, written to a temporary name and renamed, so a crash
    leaves the segment whole or absent. A flush's batch is written by pyarrow's Parquet
    writer, at about half the CPU of a DuckDB `COPY` of the same rows on the thread that
    shares the cores with training (`bench/store_write.py`). Merges stream through DuckDB,
    which reads many segments with bounded memory and writes full-sized row groups. `merge()` folds runs of `fanout` adjacent
    segments of one size class into one (a log-structured merge, as LSM trees do), so a
    day-long run at 2 s flushes keeps tens of files per table, not tens of thousands.
    Writes and merges hold the writer's lock; the collector's flusher owns a writer.
    """

    def __init__(
        self, run_dir: str | Path, table: str, writer: str, *, fanout: int = MERGE_FANOUT
    ) -> None:
        if table not in TABLES:
            raise StoreError(f"unknown table {table!r}; tables are {sorted(TABLES)}")
        if not writer or "/" in writer or writer.startswith("."):
            raise StoreError(f"writer id {writer!r} must be a plain, non-hidden file name")
        self.table = table
        self.schema = TABLES[table]
        self.fanout = fanout
        self.dir = segments_dir(Path(run_dir), table, writer)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {self.dir}: {exc.strerror or exc}") from exc
        existing = list_writer_segments(self.dir)
        # A restarted writer (torchrun restart, agent restart) continues the sequence.
        self._next_seq = max((s.last for s in existing), default=-1) + 1
        self._lock = threading.Lock()
        # Files left out of merges: the reader would skip them (their footer or columns);
        # and files found readable, until merged away.
        self._unmergeable: set[Path] = set()
        self._readable: set[Path] = set()
        self._sync_warned = False
        self.bytes_written = 0
        self.segments_written = 0

    def write(self, batch: pa.Table) -> Path | None:
        """Append one segment; returns its path, or None for an empty batch."""
        if batch.num_rows == 0:
            return None
        if batch.schema != self.schema:
            batch = batch.select(self.schema.names).cast(self.schema)
        with self._lock:
            if not self.dir.is_dir():  # removed under a running job: store what comes next
                self.dir.mkdir(parents=True, exist_ok=True)
            while True:
                seq = self._next_seq
                final = self.dir / segment_name(seq, seq)
                token = _new_token()
                try:
                    self._copy_out(batch, final, token=token)
                except _NameTaken:
                    # Another writer under the same id (a second job given this run id, or
                    # a second session in one process) took the name: go past every segment.
                    self._next_seq = self._past_every_segment(seq)
                    continue
                if self._hidden(final, seq, token):
                    # That other writer merged past `seq` and freed the name: every reader
                    # would leave this file out under the merged one. Write it again after.
                    with contextlib.suppress(OSError):
                        final.unlink()
                    self._next_seq = self._past_every_segment(seq)
                    continue
                break
            self._next_seq = seq + 1
            self.segments_written += 1
        return final

    def _past_every_segment(self, seq: int) -> int:
        return max([seq, *(s.last for s in list_writer_segments(self.dir))]) + 1

    def _hidden(self, final: Path, seq: int, token: str) -> bool:
        """Whether a segment of another writer under this id covers the one just written
        without holding its rows. This writer's own merges never reach past its next number,
        so only another writer's can. Checked after the name is claimed: gone already, or
        covered by a merge whose footer lists this file's token, means merged in (that merge
        deletes its inputs next); covered by one that does not, a merge of the earlier file
        of this name, which every reader would read in place of this one. A cover whose
        footer cannot be read counts as merged in: a row kept out is the lesser risk than
        the same row stored twice."""
        listed = list_writer_segments(self.dir)
        if not final.exists() or any(s.path == final for s in listed):
            return False
        for cover in (s for s in listed if s.first <= seq <= s.last):
            inputs = _footer_value(cover.path, INPUTS_KEY)
            if inputs is None or token in inputs.split(","):
                return False
        return True

    def _copy_out(
        self,
        source: pa.Table | list[Path],
        final: Path,
        con: duckdb.DuckDBPyConnection | None = None,
        *,
        token: str,
        inputs: list[str] | None = None,
    ) -> None:
        """Write `source` (a batch, or the segment files a merge reads through `con`) to
        `final` by way of a temporary file, with `token` (and a merge's `inputs`) in its
        footer. Raises StoreError only while the rows are not stored under `final`; a write
        whose directory cannot be fsynced once named is stored and said so in the log (a
        merge raises then, and so keeps its inputs)."""
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            if isinstance(source, pa.Table):
                self._write_batch(source, tmp, token)
            else:
                assert con is not None, "a merge reads its segments through a connection"
                meta = {TOKEN_KEY.decode(): token, INPUTS_KEY.decode(): ",".join(inputs or [])}
                kv = ", ".join(f"'{k}': '{v}'" for k, v in meta.items())  # hex and dots only
                con.execute(
                    f"COPY ({segments_select(self.table, source)}) TO {sql_path(tmp)} "
                    f"(FORMAT parquet, COMPRESSION zstd, KV_METADATA {{{kv}}})"
                )
            size = tmp.stat().st_size
            sync_path(tmp)
            if isinstance(source, pa.Table):
                _claim(tmp, final)
            else:  # a merge's name spans its inputs: only a writer of the same rows made it
                os.replace(tmp, final)
        except _NameTaken:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            # On a read-only or vanished directory the clean-up fails too; the write's own
            # error is the one to report.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write segment {final}: {exc}") from exc
        # Named: every reader reads these rows from here on, whatever follows.
        self.bytes_written += size
        try:
            sync_path(final.parent)
        except OSError as exc:
            if not isinstance(source, pa.Table):
                raise StoreError(
                    f"cannot fsync {final.parent} after merging into {final.name}: {exc}; "
                    "its inputs are kept"
                ) from exc
            if not self._sync_warned:
                self._sync_warned = True
                log.warning("trainspec: %s is stored, but fsync of its directory failed "
                            "(a host crash may lose its name): %s", final, exc)  # fmt: skip

    @staticmethod
    def _write_batch(batch: pa.Table, tmp: Path, token: str) -> None:
        # No dictionary pages (a quarter less CPU for a flush-sized batch) and no copy of
        # the Arrow schema in the footer (a demo's 2 s segment: 3.0 KB with it, 2.6 KB
        # without, DuckDB's 2.5 KB); the Parquet types say the same. Min/max statistics
        # stay, for pruning. The token goes in as one key-value pair.
        with pq.ParquetWriter(
            tmp, batch.schema, compression="zstd", use_dictionary=False, store_schema=False
        ) as writer:
            writer.write_table(batch)
            writer.add_key_value_metadata({TOKEN_KEY.decode(): token})

    def merge(self) -> int:
        """Merge every run of `fanout` adjacent same-class segments; returns merges done.

        A window with a file the reader would leave out (damaged, or of other columns) is
        not merged: DuckDB takes the first file's columns for the whole output, so one such
        file would carry its defect over the good rows merged with it. A window whose merge
        fails is skipped for the rest of this call, so the later ones still merge, and tried
        again at the next (a full disk passes); the first failure is raised once every other
        window has had its turn."""
        merges = 0
        failure: StoreError | None = None
        failed: set[Path] = set()
        con: duckdb.DuckDBPyConnection | None = None
        with self._lock:
            try:
                while (run := self._mergeable_run(failed)) is not None:
                    # Opened only for a merge and closed after it: a DuckDB connection keeps a
                    # pool of OS threads alive (8 here with threads=1, a few hundred in all on
                    # a 16-core GPU host with a writer per table), idle between flushes.
                    # One thread: a segment is small, and more would compete with training.
                    con = con or _merge_connection()
                    target = self.dir / segment_name(run[0].first, run[-1].last)
                    paths = [s.path for s in run]
                    try:
                        inputs = [_token_of(p) for p in paths]
                        self._copy_out(paths, target, con, token=_new_token(), inputs=inputs)
                    except StoreError as exc:
                        failed.update(s.path for s in run)
                        failure = failure or exc
                        continue
                    # The wider file is in place, and on disk, before the inputs go: readers
                    # keep a full view, and a crash keeps the rows.
                    for seg in run:
                        seg.path.unlink(missing_ok=True)
                        self._readable.discard(seg.path)
                    merges += 1
            finally:
                if con is not None:
                    with contextlib.suppress(duckdb.Error):  # the merge's own error counts
                        con.close()
        if failure is not None:
            raise failure
        return merges

    def _mergeable_run(self, failed: set[Path]) -> list[SegmentFile] | None:
        segs = list_writer_segments(self.dir)
        for i in range(len(segs) - self.fanout + 1):
            window = segs[i : i + self.fanout]
            classes = {_size_class(s, self.fanout) for s in window}
            contiguous = all(a.last + 1 == b.first for a, b in zip(window, window[1:]))
            if len(classes) == 1 and contiguous and self._all_readable(window, failed):
                return window
        return None

    def _all_readable(self, window: list[SegmentFile], failed: set[Path]) -> bool:
        for seg in window:
            if seg.path in self._unmergeable or seg.path in failed:
                return False
            if seg.path in self._readable:
                continue
            # Not the reader's process-wide cache: a rank's merges would fill it for good.
            if segment_problem(seg.path, self.table, cache=False) is not None:
                self._unmergeable.add(seg.path)
                return False
            self._readable.add(seg.path)
        return True


def _new_token() -> str:
    return uuid.uuid4().hex[:16]


def _footer_value(path: Path, key: bytes) -> str | None:
    """`key`'s value in a segment's Parquet footer ('' where it has none: a file written
    before ids existed); None where the footer does not read."""
    try:
        meta = pq.read_metadata(path).metadata or {}
    except Exception:  # noqa: BLE001 - pyarrow raises several types for a bad footer
        return None
    return meta.get(key, b"").decode("ascii", "replace")


def _token_of(path: Path) -> str:
    """A segment's own id ('' when unknown: the merge then says what is wrong itself)."""
    return _footer_value(path, TOKEN_KEY) or ""


def _merge_connection() -> duckdb.DuckDBPyConnection:
    # One thread: a segment is small, and DuckDB's worker pool would compete with training.
    try:
        return duckdb.connect(":memory:", config={"threads": 1})
    except (duckdb.Error, RuntimeError, OSError) as exc:  # out of memory or threads, say
        raise StoreError(f"cannot open DuckDB to merge segments: {exc}") from exc
