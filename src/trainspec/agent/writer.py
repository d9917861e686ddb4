"""The node's single writer of the run store: group commit, one segment per table per cycle.

Request threads `submit` tables and wait; the `trainspec-agent-commit` thread wakes every
`commit_interval_s`, concatenates what arrived for each run, writes one segment per table
(temporary name, then rename: a kill -9 leaves whole segments or none), and only then
releases that run's waiters. So an acknowledged batch is durable, and 64 ranks flushing cost
one file per table per cycle, not 64. Pending rows are bounded: past `pending_rows` a submit
is refused at once (the rank then writes its own segments), never queued without limit.

Runs commit on their own: each run of a cycle has its own `_Cycle`, and one run's failure
(its directory unwritable, say) fails only that run's waiters. Within a run the tables are
all or nothing: if one table's segment cannot be written, the segments already written for
that run in this cycle are removed, so a rank told "failed" (which writes the batch itself)
never finds a part of it stored twice. Merging is housekeeping after the rows are durable;
a failed merge is logged and retried next cycle, never reported to a waiter.

`healthy()` (the agent's /readyz) is recent health: no commit failed within the last
`failure_window_s` seconds. A failure long past does not keep the agent unready forever.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from trainspec.store import SegmentWriter, StoreError

log = logging.getLogger("trainspec.agent")
FAILURE_WINDOW_S = 30.0  # unready for this long after a failed commit


class Overloaded(RuntimeError):
    """More rows are waiting for a commit than the agent holds; the sender keeps them."""


@dataclass
class _Cycle:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass
class Ticket:
    """One submitted batch: the cycle that commits it, and its tables as queued (so it can be
    withdrawn, by identity, while the cycle has not started)."""

    run_id: str
    cycle: _Cycle
    parts: list[tuple[str, pa.Table]]
    rows: int
    withdrawn: bool = False


@dataclass
class _Pending:
    tables: dict[str, dict[str, list[pa.Table]]] = field(default_factory=dict)  # run, table
    cycles: dict[str, _Cycle] = field(default_factory=dict)  # run -> its waiters' result
    tickets: list[Ticket] = field(default_factory=list)  # their tables let go once committed
    rows: int = 0
    commit_by: float | None = None  # monotonic: the earliest a waiting batch needs its commit


class StoreWriter:
    """Owns every SegmentWriter of this node's agent (writer id `agent-<node>`)."""

    def __init__(
        self,
        root: str | Path,
        node_id: str,
        *,
        commit_interval_s: float,
        pending_rows: int,
        failure_window_s: float = FAILURE_WINDOW_S,
    ) -> None:
        self.root = Path(root)
        self.writer_id = f"agent-{node_id}"
        self.commit_interval_s = commit_interval_s
        self.pending_rows = pending_rows
        self.failure_window_s = failure_window_s
        self._writers: dict[tuple[str, str], SegmentWriter] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # an earlier commit_by, or close
        self._pending = _Pending()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows_written = 0
        self.segments_written = 0
        self.commit_errors = 0  # failed (run, cycle) commits since start
        self.last_failure: float | None = None  # time.monotonic() of the latest
        self.last_commit_s = 0.0
        self.run_last_seen: dict[str, float] = {}

    def start(self) -> StoreWriter:
        self._thread = threading.Thread(
            target=self._loop, name="trainspec-agent-commit", daemon=True
        )
        self._thread.start()
        return self

    def active_runs(self, within_s: float = 30.0) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [r for r, t in self.run_last_seen.items() if now - t <= within_s]

    def submit(
        self, run_id: str, tables: dict[str, pa.Table], *, commit_by: float | None = None
    ) -> Ticket:
        """Queue tables for the next commit; returns the ticket to wait on (`ticket.cycle`).
        `commit_by` (time.monotonic()) brings that commit forward when the next cycle would
        start later: a sender that waits less than `commit_interval_s` still gets its
        answer. Raises Overloaded."""
        rows = sum(t.num_rows for t in tables.values())
        with self._lock:
            if self._stop.is_set():  # checked under the lock: the final commit sees all before
                raise Overloaded("the agent is shutting down")
            if self._pending.rows + rows > self.pending_rows:
                raise Overloaded(f"{self._pending.rows} rows already wait for a commit")
            run_tables = self._pending.tables.setdefault(run_id, {})
            parts = [(name, table) for name, table in tables.items() if table.num_rows]
            for name, table in parts:
                run_tables.setdefault(name, []).append(table)
            self._pending.rows += rows
            self.run_last_seen[run_id] = time.monotonic()
            cycle = self._pending.cycles.setdefault(run_id, _Cycle())
            ticket = Ticket(run_id, cycle, parts, rows)
            self._pending.tickets.append(ticket)
            if commit_by is not None:
                due = self._pending.commit_by
                if due is None or commit_by < due:
                    self._pending.commit_by = commit_by
                    self._wake.notify_all()
            return ticket

    def withdraw(self, ticket: Ticket) -> bool:
        """Take a batch back if its commit has not started: True, and it will never be
        stored. False once the commit thread holds it (it is being, or was, written)."""
        with self._lock:
            if ticket.withdrawn:
                return True
            if self._pending.cycles.get(ticket.run_id) is not ticket.cycle:
                return False
            run_tables = self._pending.tables.get(ticket.run_id, {})
            for name, table in ticket.parts:
                queued = run_tables.get(name, [])
                for i, candidate in enumerate(queued):
                    if candidate is table:
                        del queued[i]
                        break
                if not queued:  # no table of that name left to write this cycle
                    run_tables.pop(name, None)
            self._pending.rows -= ticket.rows
            ticket.withdrawn = True
            ticket.parts = []
            return True

    def pending(self) -> int:
        with self._lock:
            return self._pending.rows

    def _loop(self) -> None:
        """A commit every `commit_interval_s`, or sooner when a waiting batch needs it."""
        next_at = time.monotonic() + self.commit_interval_s
        while True:
            with self._lock:
                while not self._stop.is_set():
                    due = self._pending.commit_by
                    left = (next_at if due is None else min(next_at, due)) - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._stop.is_set():
                    return  # close() commits what is left
            self.commit()
            next_at = time.monotonic() + self.commit_interval_s

    def healthy(self) -> bool:
        """No commit failed within the last `failure_window_s` seconds."""
        last = self.last_failure
        return last is None or time.monotonic() - last > self.failure_window_s

    def commit(self) -> None:
        """Write everything pending now (the commit thread, and once more at close)."""
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        t0 = time.monotonic()
        for run_id, cycle in pending.cycles.items():
            cycle.error = self._commit_run(run_id, pending.tables.get(run_id, {}))
            if cycle.error is not None:
                self.commit_errors += 1
                self.last_failure = time.monotonic()
                log.warning("trainspec-agent: commit of run %s failed: %s", run_id, cycle.error)
            cycle.done.set()  # this run's waiters go now, whatever the next run does
        for ticket in pending.tickets:
            ticket.parts = []  # a ticket outlives its commit (agent/batch_ledger.py); its rows not
        self.last_commit_s = time.monotonic() - t0

    def _commit_run(self, run_id: str, tables: dict[str, list[pa.Table]]) -> str | None:
        """Write one run's tables, all or none; the error, or None once they are durable."""
        written: list[Path] = []
        try:
            writers = {name: self._writer(run_id, name) for name in tables}  # dirs first
            for name, parts in tables.items():
                if not parts:
                    continue
                path = writers[name].write(pa.concat_tables(parts))
                if path is not None:
                    written.append(path)
        except Exception as exc:  # any failure: one run's, and the commit thread goes on
            self._remove(written)
            return str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
        self.rows_written += sum(p.num_rows for parts in tables.values() for p in parts)
        self.segments_written += len(written)
        for writer in writers.values():
            try:
                writer.merge()
            except Exception as exc:  # the rows are stored; merged next cycle
                log.warning("trainspec-agent: merge in run %s failed: %s", run_id, exc)
        return None

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # stays visible: the run's rows may be read twice
                log.error("trainspec-agent: cannot remove %s after a failed commit: %s", path, exc)

    def _writer(self, run_id: str, table: str) -> SegmentWriter:
        key = (run_id, table)
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = SegmentWriter(self.root / run_id, table, self.writer_id)
        return writer

    def close(self, *, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._stop.set()
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.commit()
