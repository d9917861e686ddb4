"""Hardware health from the samplers' readings: a new uncorrected ECC error, a newly remapped
memory row (after a correctable or an uncorrectable error: NVML's two counts summed), a
critical Xid, or the start of thermal or power-brake slowdown on one of this rank's GPUs
becomes a fault, which the controller hears as FLAG_HARDWARE (and which makes the
checkpoint policy save at once).

`observe` runs on the collector's sampler thread (a reading tap); `take` on the training
thread at the step boundary. Between them only a lock-guarded list is shared.

Counters are judged against their first reading on this rank (what the GPU had before the
job started is not this job's fault), so only a rise is a fault. Throttling is a state, not
a count: it is a fault when it starts, and it is re-armed only after the GPU has run
unthrottled for `rearm_s` (10 minutes), so a GPU hovering at its limit costs one urgent
checkpoint per episode, not one a minute.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainspec.collector.records import Reading

# NVML clocks-event (throttle) reason bits: SW thermal slowdown, HW thermal slowdown,
# HW slowdown (thermal or power brake) and HW power-brake slowdown (nvml.h,
# nvmlClocksEventReason*).
THERMAL_THROTTLE_MASK = 0x20 | 0x40 | 0x08 | 0x80
_COUNTERS = {
    "trainspec.gpu.errors.ecc": "uncorrected ECC errors",
    "trainspec.gpu.errors.remapped_rows": "remapped memory rows",
    "trainspec.gpu.errors.xid": "critical Xid errors",
}
THROTTLE_METRIC = "trainspec.gpu.throttle_reasons"


@dataclass(frozen=True)
class HardwareFault:
    gpu: str  # the GPU's index (or its attributes when they carry none)
    kind: str  # "ecc" | "remapped_rows" | "xid" | "thermal"
    reason: str
    evidence: dict[str, Any]


class HardwareHealthWatch:
    def __init__(self, *, rearm_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.rearm_s = rearm_s
        self._clock = clock
        self._lock = threading.Lock()
        self._first: dict[tuple[str, str], float] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._throttled_since: dict[str, float] = {}
        self._clear_since: dict[str, float] = {}
        self._faults: list[HardwareFault] = []

    def observe(self, readings: Sequence[Reading]) -> None:
        """A reading tap: called with every batch of readings a sampler produced."""
        for reading in readings:
            metric = reading[0]
            if metric in _COUNTERS:
                self._counter(metric, _gpu(reading[2]), float(reading[1]))
            elif metric == THROTTLE_METRIC:
                self._throttle(_gpu(reading[2]), int(reading[1]))

    def take(self) -> list[HardwareFault]:
        """Faults seen since the last call (training thread, at a step boundary)."""
        with self._lock:
            faults, self._faults = self._faults, []
        return faults

    def _counter(self, metric: str, gpu: str, value: float) -> None:
        key = (metric, gpu)
        first = self._first.setdefault(key, value)
        last = self._last.get(key, first)
        self._last[key] = value
        if value > last:
            what = _COUNTERS[metric]
            kind = metric.rsplit(".", 1)[1]
            self._add(
                HardwareFault(
                    gpu, kind, f"GPU {gpu}: {what} rose from {last:g} to {value:g}",
                    {"metric": metric, "before": last, "after": value, "at_start": first},
                )
            )  # fmt: skip

    def _throttle(self, gpu: str, reasons: int) -> None:
        now = self._clock()
        thermal = reasons & THERMAL_THROTTLE_MASK
        if not thermal:
            self._clear_since.setdefault(gpu, now)
            if gpu in self._throttled_since and now - self._clear_since[gpu] >= self.rearm_s:
                del self._throttled_since[gpu]
            return
        self._clear_since.pop(gpu, None)
        if gpu in self._throttled_since:
            return  # still (or again, before re-arming) in the episode already reported
        self._throttled_since[gpu] = now
        self._add(
            HardwareFault(
                gpu, "thermal", f"GPU {gpu}: thermal or power-brake slowdown "
                f"(clock event reasons {reasons:#x})",
                {"metric": THROTTLE_METRIC, "reasons": reasons, "thermal_bits": thermal},
            )
        )  # fmt: skip

    def _add(self, fault: HardwareFault) -> None:
        with self._lock:
            self._faults.append(fault)


def _gpu(attrs: str) -> str:
    try:
        return str(json.loads(attrs).get("gpu.index", attrs))
    except ValueError:
        return attrs
