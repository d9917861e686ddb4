"""The node's single writer of the run store: group commit, one segment per table per cycle.

Request threads `submit` tables and wait; the `trainspec-agent-commit` thread wakes every
`commit_interval_s`, concatenates what arrived for each run, writes one segment per table
(temporary name, then rename: a kill -9 leaves whole segments or none), merges, and only then
releases the waiters. So an acknowledged batch is durable, and 64 ranks flushing cost one
file per table per cycle, not 64. Pending rows are bounded: past `pending_rows` a submit is
refused at once (the rank then writes its own segments), never queued without limit.
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


class Overloaded(RuntimeError):
    """More rows are waiting for a commit than the agent holds; the sender keeps them."""


@dataclass
class _Cycle:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass
class _Pending:
    tables: dict[tuple[str, str], list[pa.Table]] = field(default_factory=dict)  # (run, table)
    rows: int = 0
    cycle: _Cycle = field(default_factory=_Cycle)


class StoreWriter:
    """Owns every SegmentWriter of this node's agent (writer id `agent-<node>`)."""

    def __init__(
        self, root: str | Path, node_id: str, *, commit_interval_s: float, pending_rows: int
    ) -> None:
        self.root = Path(root)
        self.writer_id = f"agent-{node_id}"
        self.commit_interval_s = commit_interval_s
        self.pending_rows = pending_rows
        self._writers: dict[tuple[str, str], SegmentWriter] = {}
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows_written = 0
        self.segments_written = 0
        self.commit_errors = 0
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

    def submit(self, run_id: str, tables: dict[str, pa.Table]) -> _Cycle:
        """Queue tables for the next commit; returns the cycle to wait on. Raises Overloaded."""
        rows = sum(t.num_rows for t in tables.values())
        with self._lock:
            if self._stop.is_set():  # checked under the lock: the final commit sees all before
                raise Overloaded("the agent is shutting down")
            if self._pending.rows + rows > self.pending_rows:
                raise Overloaded(f"{self._pending.rows} rows already wait for a commit")
            for name, table in tables.items():
                if table.num_rows:
                    self._pending.tables.setdefault((run_id, name), []).append(table)
            self._pending.rows += rows
            self.run_last_seen[run_id] = time.monotonic()
            return self._pending.cycle

    def pending(self) -> int:
        with self._lock:
            return self._pending.rows

    def _loop(self) -> None:
        while not self._stop.wait(self.commit_interval_s):
            self.commit()

    def commit(self) -> None:
        """Write everything pending now (the commit thread, and once more at close)."""
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        t0 = time.monotonic()
        try:
            for (run_id, name), parts in pending.tables.items():
                writer = self._writer(run_id, name)
                writer.write(pa.concat_tables(parts))
                writer.merge()
                self.rows_written += sum(p.num_rows for p in parts)
                self.segments_written += 1
        except (StoreError, OSError, pa.ArrowException) as exc:
            self.commit_errors += 1
            pending.cycle.error = str(exc)
            log.warning("trainspec-agent: commit failed: %s", exc)
        self.last_commit_s = time.monotonic() - t0
        pending.cycle.done.set()

    def _writer(self, run_id: str, table: str) -> SegmentWriter:
        key = (run_id, table)
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = SegmentWriter(self.root / run_id, table, self.writer_id)
        return writer

    def close(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.commit()
        for writer in self._writers.values():
            writer.close()
