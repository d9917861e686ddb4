"""The telemetry's own health: points dropped so that training was never blocked."""

from __future__ import annotations

from collections.abc import Callable

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler


class TelemetrySampler(Sampler):
    """Reports the cumulative drop counter each second (a counter: never goes down)."""

    name = "telemetry"
    interval_s = 1.0
    final_reading = True
    latest_slot = True  # never lost to the queue whose overflow it counts

    def __init__(self, dropped_total: Callable[[], int]) -> None:
        self._dropped_total = dropped_total
        self._attrs = attrs_json()

    def sample(self, now: float) -> list[Reading]:
        return [("trainspec.telemetry.dropped", float(self._dropped_total()), self._attrs)]
