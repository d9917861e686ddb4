"""StoreSink: every raw reading, step and event into the run store's segments."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from trainspec.collector.records import Batch
from trainspec.collector.sink import PartialWrite, Sink
from trainspec.store import SegmentWriter, StoreError
from trainspec.store.journal import Journal, Salvaged, salvage

log = logging.getLogger("trainspec.collector")


class StoreSink(Sink):
    """Writes one segment per table per flush for this writer, and merges small segments."""

    name = "store"
    durable = True

    def __init__(
        self,
        run_dir: str | Path,
        writer: str,
        *,
        fanout: int = 16,
        journal_rank: int | None = None,
    ) -> None:
        """With `journal_rank`, first store what an earlier process of this writer journaled
        and never flushed (a killed rank's restart), then start this process's journal
        (`self.journal`, for the collector; None when it cannot be written)."""
        self.run_dir = Path(run_dir)
        self._writers = {
            table: SegmentWriter(self.run_dir, table, writer, fanout=fanout)
            for table in ("samples", "steps", "events", "runs")
        }
        self._merger = SegmentMerger()
        self.journal: Journal | None = None
        if journal_rank is not None:
            self.salvaged = _salvage_earlier(self.run_dir, writer, fanout)
            try:
                self.journal = Journal(self.run_dir, writer, journal_rank)
            except StoreError as exc:
                log.warning("trainspec: %s; rows not yet flushed are lost if killed", exc)

    @property
    def merge_failures(self) -> int:
        return self._merger.failures

    @property
    def bytes_written(self) -> int:
        return sum(w.bytes_written for w in self._writers.values())

    def write_run_row(self, row: pa.Table) -> None:
        self._writers["runs"].write(row)

    def write(self, batch: Batch) -> None:
        """Each table's rows on their own: a table that fails (a full disk, say) does not
        keep the others' rows, the events above all, from being tried. Raises
        `PartialWrite` naming the failed tables and their rows, after the rest are stored."""
        parts = [("samples", batch.samples.num_rows, lambda: batch.samples)]
        if batch.steps:
            parts.append(("steps", len(batch.steps), batch.steps_table))
        if batch.events:
            parts.append(("events", len(batch.events), batch.events_table))
        lost, errors = 0, []
        for table, rows, rows_table in parts:
            try:
                self._writers[table].write(rows_table())
            except Exception as exc:  # noqa: BLE001 - the next table is tried all the same
                lost += rows
                errors.append(f"{table}: {exc}")
        self._merger.merge(self._writers.values())
        if errors:
            raise PartialWrite("; ".join(errors), lost)

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Nothing to release: every flush writes whole segments and holds nothing open."""


class SegmentMerger:
    """Merges writers' small segments after a batch is stored in every table. A failed
    merge is housekeeping, retried at the next flush: counted and said once, never raised
    (raised, it counted a stored batch as dropped, or left the batch's other tables
    unwritten)."""

    def __init__(self) -> None:
        self.failures = 0

    def merge(self, writers: Iterable[SegmentWriter]) -> None:
        for writer in writers:
            try:
                writer.merge()
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                self.failures += 1
                if self.failures == 1:
                    log.warning("trainspec: merging %s segments failed (retried at each flush; "
                                "the rows are stored): %s", writer.table, exc)  # fmt: skip


def _salvage_earlier(run_dir: Path, writer: str, fanout: int) -> Salvaged | None:
    """Store an earlier process's journaled rows of `writer`; said, never raised."""
    try:
        done = salvage(run_dir, writer, fanout=fanout)
    except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
        log.warning("trainspec: rows an earlier process of %s journaled were not stored: %s",
                    writer, exc)  # fmt: skip
        return None
    if done.total:
        log.warning("trainspec: stored %d rows that an earlier process of %s had not "
                    "flushed when it ended (%s)", done.total, writer,
                    ", ".join(f"{t} {n}" for t, n in sorted(done.rows.items())))  # fmt: skip
    for path, why in done.unreadable:
        log.warning("trainspec: journal file %s left as it is: %s", path, why)
    return done
