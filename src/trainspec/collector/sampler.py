"""The Sampler contract."""

from __future__ import annotations

from abc import ABC, abstractmethod

from trainspec.collector.records import Reading


class Sampler(ABC):
    """Produces readings of catalogue metrics.

    `interval_s` is how often the collector calls `sample()`; it must not be finer than the
    source's true resolution (the catalogue's `resolution_s`). `unavailable_reason()` is
    asked once at start: a string means "not on this machine", said once, and the sampler
    is skipped; None means it runs.
    """

    name: str = "sampler"
    interval_s: float = 0.05
    # A sampler whose readings time other ranks (the latency probe) never runs at a lowered
    # priority: with `collector.thread_nice` above 0 it gets a thread of its own at the
    # process's priority, else it shares the sampling thread. It must not wait on a peer in
    # `sample()` either way.
    times_peers: bool = False
    # Read at close before the last flush to every sink, and again after the exporters
    # shut down, for the store (the drop counter).
    final_reading: bool = False
    # Its readings are never refused by the collector's full sample queue: past the
    # capacity each of its series keeps one slot with its latest reading. For the drop
    # counter, which counts that queue's overflow (its readings were dropped with it).
    latest_slot: bool = False

    def unavailable_reason(self) -> str | None:
        return None

    @abstractmethod
    def sample(self, now: float) -> list[Reading]:
        """Readings at wall time `now` (unix seconds)."""

    def closing_readings(self, now: float) -> list[Reading]:
        """Readings to make once more at close, as soon as the sampling threads have stopped
        (before the last flush): none unless the sampler has something a short-lived
        collector would otherwise miss (the host sampler's first rate)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the sampler holds (handles, groups)."""
