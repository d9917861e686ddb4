"""The collector: samplers produce readings, the collector decides when, sinks decide where.

Contract:
- A `Sampler` (one file each under `samplers/`) says whether it is available on this machine
  (once, with a reason when not) and returns readings `(metric, value, attrs_json)` when
  asked. It never raises into the collector: a failing sampler is disabled and reported.
- A `Sink` (one file each under `sinks/`) consumes `Batch`es: `write`, `flush`, `close`.
  The store sink gets every raw reading; the OpenTelemetry and Prometheus sinks aggregate.
- `Collector` runs the samplers on a named daemon thread at their intervals, takes step
  records and events from the training thread without blocking it (bounded buffers; what
  does not fit is dropped and counted in `trainspec.telemetry.dropped`), and hands a batch
  to every sink on a second thread every flush interval and at close. A sink that raises is
  contained and counted; training never waits on telemetry.
"""

from __future__ import annotations

from trainspec.collector.collector import Collector
from trainspec.collector.records import Batch, EventRecord, StepRecord
from trainspec.collector.sampler import Sampler
from trainspec.collector.sink import Sink

__all__ = ["Batch", "Collector", "EventRecord", "Sampler", "Sink", "StepRecord"]
