"""The journal: a writer's rows that are not in a segment yet, appended as they arrive.

A writer flushes its buffered rows into segments every `store.flush_interval_s` (2 s). A
process killed between flushes (kill -9, the kernel's OOM killer, a lost node's last
seconds) lost those rows, which are the ones that show what led up to the failure. Now the
collector also appends them, as they reach it, to a small file per writer and flush:

    RUN_DIR/journal/<writer>/<pid>-<token>.<generation>.jsonl

one JSON header line (format, rank), then one line per table and sampling tick: ``[table,
[row, ...]]``, each row in the table's column order, for steps and events; ``["samples",
[metric, ...], [attrs, ...], hex]`` for readings, their times and values as one hex string
of little-endian float64s (times, then values): `json.dumps` spends most of its time
formatting floats, 76 us for a tick of 30 readings against 19 us this way
(`bench/journal.py`). Writes are plain `write(2)`s, no fsync: a killed process's writes are
in the page cache and survive it; a machine that loses power loses them (the segments
themselves are fsynced).

Each flush starts a new generation (`rotate`) with the same rows it takes from the buffers,
writes its segments, and then deletes the generation (`retire`); a generation whose rows
failed to store is closed and kept, unless a failed write (a full disk) left it without
some of them: its rows are counted as dropped, and it is deleted. The live process holds an exclusive `flock` on every
generation it may still retire, so another process never salvages it.

`salvage` turns the generations of dead processes into segments of the same writer: a
restarted rank does so for its own writer at start, `trainspec compact` for every writer,
`trainspec run` when the job ends. A process killed after a flush's segment was renamed but
before its generation was deleted leaves rows that are stored already: a generation's rows
of one table went into one segment together, so its first row is looked up in the writer's
segments, and found, the table's rows of that generation are not stored again.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from trainspec.store.errors import StoreError, first_line
from trainspec.store.layout import list_writer_segments, parquet_path, segments_dir
from trainspec.store.tables import TABLES, to_arrow

log = logging.getLogger("trainspec.store")

JOURNAL_DIR = "journal"
FORMAT = 1
MAX_KEPT = 64  # generations kept after failed flushes before journaling stops
MKDIR_ATTEMPTS = 5  # the shared journal directory removed under a new journal (`_first_open`)
_NAME = re.compile(r"^(\d+-[0-9a-f]+)\.(\d{6,})\.jsonl$")
_TMP = ".tmp"  # `.<name>.tmp`: a generation before its header is written
# A stored row is found again by its time and one column that tells rows of a moment apart.
_KEY = {"samples": "metric", "steps": "step", "events": "name"}


def journal_dir(run_dir: Path, writer: str | None = None) -> Path:
    base = run_dir / JOURNAL_DIR
    return base / writer if writer is not None else base


@dataclass
class Generation:
    """One open journal file; `fd` holds its flock while the process may still retire it
    (-1 once closed). `complete`: every row handed to it was written."""

    path: Path
    fd: int
    complete: bool = True


class Journal:
    """Appends one writer's unflushed rows. Not thread-safe: the collector calls `append`,
    `rotate` and `close` under one lock, so a generation holds the rows a flush takes, and
    also, for a series the sample buffer keeps in one slot past its capacity (the drop
    counter: `_SampleBuffer.extend`), the readings that slot replaced: a salvage stores a
    cumulative counter's earlier readings too, which says nothing wrong. After `close` (or
    `forget_in_child`) every call does nothing."""

    def __init__(self, run_dir: str | Path, writer: str, rank: int) -> None:
        self.dir = journal_dir(Path(run_dir), writer)
        self.rank = rank
        self._name = f"{os.getpid()}-{secrets.token_hex(4)}"  # two sessions of one process
        self._generation = 0
        self._held: dict[int, Generation] = {}  # by fd: the generations this process has open
        self.kept = 0  # generations left for salvage after failed flushes
        self.failed: str | None = None  # why journaling stopped, once it has
        self.closed = False
        try:
            self.current: Generation | None = self._first_open()
        except OSError as exc:
            raise StoreError(f"cannot start the journal in {self.dir}: {exc}") from exc

    def _first_open(self) -> Generation:
        """The journal's directory and first generation. The run's `journal/` is shared:
        another rank's salvage or close removes it once empty (`rmdir`), which can fall
        between this `mkdir` making it and making this writer's directory in it, or before
        the first generation is in that (rank 0 then ran without a journal, "No such file
        or directory"). Made again then: a directory that holds a generation is never
        removed."""
        attempts = MKDIR_ATTEMPTS
        while True:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                return self._open()
            except FileNotFoundError:
                attempts -= 1
                if not attempts:
                    raise

    def _open(self) -> Generation:
        """A new generation, locked and with its header before it has its name: a reader
        that finds the name (validate, a salvage) never meets an empty, unlocked file."""
        final = self.dir / f"{self._name}.{self._generation:06d}.jsonl"
        self._generation += 1
        tmp = final.with_name(f".{final.name}{_TMP}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, (json.dumps({"format": FORMAT, "rank": self.rank}) + "\n").encode())
            os.rename(tmp, final)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        generation = Generation(final, fd)
        self._held[fd] = generation
        return generation

    def append(self, table: str, rows: Sequence[Sequence[Any]]) -> None:
        """One line of `table` rows (steps or events)."""
        if rows:
            self._write(lambda: json.dumps([table, rows], separators=(",", ":"), default=str))

    def append_samples(
        self, ts: list[float], metric: list[str], value: list[float], attrs: list[str]
    ) -> None:
        """One line of readings, by column."""
        if ts:
            self._write(
                lambda: json.dumps(
                    ["samples", metric, attrs, _floats_hex(ts + value)], separators=(",", ":")
                )  # fmt: skip
            )

    def _write(self, line: Callable[[], str]) -> None:
        """A failure (a full disk) ends journaling, said once; the rows still reach the
        segments at the next flush."""
        current = self.current
        if current is None or self.closed or self.failed is not None:
            return
        try:
            os.write(current.fd, (line() + "\n").encode())
        except (OSError, TypeError, ValueError) as exc:
            current.complete = False
            self._stop(f"{type(exc).__name__}: {exc}")

    def _stop(self, why: str) -> None:
        self.failed = why
        log.warning(
            "trainspec: the store's journal stopped (%s): rows not yet flushed are lost if "
            "this process is killed",
            why,
        )

    def rotate(self) -> Generation | None:
        """Start the next generation (none once journaling stopped); the previous one, for
        `retire` or `keep`."""
        if self.closed:
            return None
        previous, self.current = self.current, None
        if self.failed is None:
            try:
                self.current = self._open()
            except OSError as exc:
                self._stop(f"{type(exc).__name__}: {exc}")
        return previous

    def _release(self, generation: Generation) -> None:
        if generation.fd >= 0:
            self._held.pop(generation.fd, None)
            with contextlib.suppress(OSError):
                os.close(generation.fd)
            generation.fd = -1

    def retire(self, generation: Generation | None) -> None:
        """Its rows are in segments: delete it (then release its lock)."""
        if generation is None or generation.fd < 0:
            return
        with contextlib.suppress(OSError):
            generation.path.unlink()
        self._release(generation)

    def keep(self, generation: Generation | None) -> None:
        """Its rows failed to store: leave it, unlocked, for `salvage`, if it holds all of
        them (`complete`); one that does not is deleted, its rows dropped. A store that keeps
        failing would fill the disk with generations: after `MAX_KEPT`, journaling stops."""
        if generation is None or generation.fd < 0:
            return
        if not generation.complete:
            # Journaling stopped part-way through it (a full disk): the collector counts its
            # rows as dropped, not deferred. Left for salvage, the part of them it holds was
            # stored by the next compact too, after a clean close (counted and stored).
            self.retire(generation)
            return
        self._release(generation)
        self.kept += 1
        if self.kept >= MAX_KEPT and self.failed is None:
            self._stop(f"{self.kept} flushes failed to store")

    def close(self) -> None:
        """At the end, after the last flush took every row: the current generation holds
        none, so it goes too."""
        if self.closed:
            return
        self.retire(self.current)
        self.current = None
        self.closed = True
        for d in (self.dir, self.dir.parent):  # only if empty: kept generations stay
            with contextlib.suppress(OSError):
                d.rmdir()

    def forget_in_child(self) -> None:
        """In a forked child: close its copies of the generations' descriptors, so the
        parent's locks end with the parent (a DataLoader worker that outlived a killed rank
        kept its journal looking alive). Closing a copy leaves the parent's lock held."""
        for fd in list(self._held):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held.clear()
        self.current = None
        self.closed = True


@dataclass
class Salvaged:
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows stored from journals
    already: int = 0  # generations' tables found stored already
    files: int = 0  # generations read and removed
    unreadable: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def _generations(run_dir: Path, writer: str) -> list[Path]:
    found = []
    with contextlib.suppress(OSError):
        for entry in journal_dir(run_dir, writer).iterdir():
            m = _NAME.match(entry.name)
            if m and entry.is_file():
                found.append((m.group(1), int(m.group(2)), entry))
    return [path for _, _, path in sorted(found)]


def journal_writers(run_dir: Path) -> list[str]:
    """Writers with journal files left under `run_dir` (their own process may be alive)."""
    with contextlib.suppress(OSError):
        return sorted(
            d.name for d in journal_dir(run_dir).iterdir() if _generations(run_dir, d.name)
        )
    return []


@contextlib.contextmanager
def _dead_writers_file(path: Path) -> Iterator[int | None]:
    """The file's descriptor, locked, if no live process holds it; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


def _floats_hex(values: list[float]) -> str:
    a = array.array("d", values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes().hex()


def _hex_floats(text: str) -> list[float]:
    a = array.array("d", bytes.fromhex(text))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _sample_rows(line: list[Any]) -> list[list[Any]]:
    """A samples line's readings as rows [ts, metric, value, attrs]."""
    _, metric, attrs, packed = line
    floats = _hex_floats(packed)
    n = len(metric)
    if len(attrs) != n or len(floats) != 2 * n:
        raise ValueError("a samples line whose columns differ in length")
    return [[floats[i], metric[i], floats[n + i], attrs[i]] for i in range(n)]


def _read_generation(fd: int) -> tuple[int, dict[str, list[list[Any]]]]:
    """(rank, table -> rows) of one generation. A last line cut short by the kill is left
    out; any other line that does not read makes the file unreadable (ValueError)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        lines = f.read().split(b"\n")
    if lines == [b""]:
        return -1, {}  # created and never written: nothing in it
    if not lines[0]:
        raise ValueError("no header")
    header = json.loads(lines[0])
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"not a trainspec journal of format {FORMAT}")
    rank = header.get("rank")
    if not isinstance(rank, int):
        raise ValueError("header has no rank")
    tables: dict[str, list[list[Any]]] = {}
    body = lines[1:]
    for i, line in enumerate(body):
        if not line:
            continue
        try:
            parsed = json.loads(line)
        except ValueError:
            if i == len(body) - 1:
                break  # written in part when the process died
            raise
        if not isinstance(parsed, list) or not parsed or parsed[0] not in _KEY:
            raise ValueError(f"line {i + 2}: not a line of a known table")
        table = parsed[0]
        rows = _sample_rows(parsed) if table == "samples" else parsed[1]
        if not isinstance(rows, list):
            raise ValueError(f"line {i + 2}: no rows")
        tables.setdefault(table, []).extend(rows)
    return rank, tables


def _columns(table: str, rank: int, rows: list[list[Any]]) -> dict[str, list]:
    names = [f.name for f in TABLES[table]]
    if table == "samples":  # journaled without the rank: one writer, one rank
        names = [n for n in names if n != "rank"]
    cols: dict[str, list] = {n: [] for n in names}
    for row in rows:
        if not isinstance(row, list) or len(row) != len(names):
            raise ValueError(f"a {table} row of {len(row) if isinstance(row, list) else 0} values")
        for name, value in zip(names, row, strict=True):
            cols[name].append(value)
    if table == "samples":
        cols["rank"] = [rank] * len(rows)
    return cols


class _CannotTell(Exception):
    """The writer's segments could not be read to tell whether a generation is stored."""


def _stored(run_dir: Path, table: str, writer: str, first: dict[str, list]) -> bool:
    """Whether the writer's readable segments of `table` hold the row whose columns are
    `first`'s first values; `_CannotTell` when reading them fails (damage behind a footer)."""
    from trainspec.store.reader import segment_problem  # the reader imports the store

    segments = list_writer_segments(segments_dir(run_dir, table, writer))
    files = [s.path for s in segments if segment_problem(s.path, table) is None]
    if not files:
        return False
    ts, key = first["ts"][0], first[_KEY[table]][0]
    listing = ", ".join(parquet_path(p) for p in files)
    sql = (
        f"SELECT count(*) FROM read_parquet([{listing}], union_by_name=true) "
        f'WHERE ts = ? AND "{_KEY[table]}" IS NOT DISTINCT FROM ?'
    )
    try:
        with duckdb.connect() as con:
            return bool(con.execute(sql, [ts, key]).fetchall()[0][0])
    except duckdb.Error as exc:
        raise _CannotTell(
            f"cannot tell whether its {table} rows are stored: {first_line(exc)}"
        ) from exc


def _remove_dead_unnamed(run_dir: Path, writer: str) -> None:
    """Generations a process died with before naming them (no rows yet): removed."""
    with contextlib.suppress(OSError):
        for entry in journal_dir(run_dir, writer).iterdir():
            if entry.name.startswith(".") and entry.name.endswith(_TMP):
                with _dead_writers_file(entry) as fd:
                    if fd is not None:
                        entry.unlink(missing_ok=True)


def unsalvaged_writers(run_dir: Path) -> list[str]:
    """Writers with journal files no live process holds: rows `salvage` would store."""
    found = []
    for writer in journal_writers(run_dir):
        for path in _generations(run_dir, writer):
            with _dead_writers_file(path) as fd:
                if fd is not None:
                    found.append(writer)
                    break
    return found


def salvage(run_dir: str | Path, writer: str, *, fanout: int | None = None) -> Salvaged:
    """Store the rows that dead processes of `writer` journaled and never flushed, as
    segments of that writer; delete those generations. Raises StoreError when a segment
    cannot be written (the generation is kept for another try)."""
    from trainspec.store.segments import MERGE_FANOUT, SegmentWriter  # imports this module

    run_dir = Path(run_dir)
    done = Salvaged()
    writers: dict[str, SegmentWriter] = {}
    _remove_dead_unnamed(run_dir, writer)
    for path in _generations(run_dir, writer):
        with _dead_writers_file(path) as fd:
            if fd is None:
                continue  # a live process's: it flushes these rows itself
            try:
                rank, tables = _read_generation(fd)
                columns = {t: _columns(t, rank, rows) for t, rows in tables.items() if rows}
            except (ValueError, TypeError) as exc:
                done.unreadable.append((path, first_line(exc)))
                continue
            try:
                stored = {t: _stored(run_dir, t, writer, cols) for t, cols in columns.items()}
            except _CannotTell as exc:
                done.unreadable.append((path, str(exc)))
                continue
            for table, cols in columns.items():
                if stored[table]:
                    done.already += 1
                    continue
                if table not in writers:
                    writers[table] = SegmentWriter(
                        run_dir, table, writer, fanout=fanout or MERGE_FANOUT
                    )
                try:
                    writers[table].write(to_arrow(table, cols))
                except Exception as exc:
                    raise StoreError(f"salvaging {path}: {exc}") from exc
                done.rows[table] = done.rows.get(table, 0) + len(next(iter(cols.values())))
            with contextlib.suppress(OSError):
                path.unlink()
            done.files += 1
    with contextlib.suppress(OSError):
        journal_dir(run_dir, writer).rmdir()
    with contextlib.suppress(OSError):
        journal_dir(run_dir).rmdir()
    return done


def salvage_run(run_dir: str | Path) -> Salvaged:
    """`salvage` for every writer of the run with journal files left."""
    total = Salvaged()
    for writer in journal_writers(Path(run_dir)):
        try:
            one = salvage(run_dir, writer)
        except StoreError as exc:  # one writer's failure leaves the others' to do
            total.unreadable.append((journal_dir(Path(run_dir), writer), str(exc)))
            continue
        for table, n in one.rows.items():
            total.rows[table] = total.rows.get(table, 0) + n
        total.already += one.already
        total.files += one.files
        total.unreadable += one.unreadable
    return total
