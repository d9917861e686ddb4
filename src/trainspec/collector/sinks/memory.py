"""InMemorySink: keeps every batch, for tests (as OTel's InMemoryMetricReader does)."""

from __future__ import annotations

import threading

import pyarrow as pa

from trainspec.collector.records import Batch, EventRecord, StepRecord
from trainspec.collector.sink import Sink


class InMemorySink(Sink):
    name = "memory"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: list[Batch] = []
        self.closed = 0

    def write(self, batch: Batch) -> None:
        with self._lock:
            self.batches.append(batch)

    def close(self, *, timeout_s: float = 5.0) -> None:
        self.closed += 1

    def samples(self) -> pa.Table:
        with self._lock:
            tables = [b.samples for b in self.batches]
        return pa.concat_tables(tables) if tables else pa.table({})

    def values(self, metric: str) -> list[float]:
        """Every raw value recorded for `metric` (a lookup helper for tests)."""
        t = self.samples()
        if t.num_rows == 0:
            return []
        return [v for m, v in zip(t["metric"].to_pylist(), t["value"].to_pylist()) if m == metric]

    def steps(self) -> list[StepRecord]:
        with self._lock:
            return [s for b in self.batches for s in b.steps]

    def events(self) -> list[EventRecord]:
        with self._lock:
            return [e for b in self.batches for e in b.events]
