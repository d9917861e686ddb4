"""The Sink contract."""

from __future__ import annotations

from abc import ABC, abstractmethod

from trainspec.collector.records import Batch


class PartialWrite(Exception):
    """A write that stored part of its batch: `lost` points of it were not stored. The
    collector counts those as dropped, not the whole batch."""

    def __init__(self, message: str, lost: int) -> None:
        super().__init__(message)
        self.lost = lost


class Sink(ABC):
    """Consumes batches on the collector's flush thread (never the training thread).

    `write` may be slow (disk, network) but must return; `close` is idempotent and bounded
    by `timeout_s`. Exceptions are contained by the collector, counted, and the batch's
    points are counted as dropped for this sink (a `PartialWrite`'s `lost` points only).
    """

    name: str = "sink"
    dropped: int = 0  # points this sink could not deliver (e.g. an unreachable endpoint)
    # A durable sink (the run store) is closed last, so it also receives the final drop
    # count, which includes what the exporters lost while shutting down.
    durable: bool = False

    @abstractmethod
    def write(self, batch: Batch) -> None: ...

    def flush(self, *, timeout_s: float = 5.0) -> None:  # noqa: B027 - optional hook
        """Push out anything buffered."""

    def close(self, *, timeout_s: float = 5.0) -> None:  # noqa: B027 - optional hook
        """Flush and release; idempotent."""
