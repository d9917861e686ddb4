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
    # A sampler that waits on other processes (the latency probe) gets a thread of its own,
    # so a slow peer cannot delay this rank's other readings.
    dedicated_thread: bool = False

    def unavailable_reason(self) -> str | None:
        return None

    @abstractmethod
    def sample(self, now: float) -> list[Reading]:
        """Readings at wall time `now` (unix seconds)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the sampler holds (handles, groups)."""
