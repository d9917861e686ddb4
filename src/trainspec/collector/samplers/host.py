"""Process and host CPU and memory: the utilization family for CPU training."""

from __future__ import annotations

import psutil

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.host_readings import (
    HostCounters,
    HostCounterSource,
    open_host_counters,
)

_NO_ATTRS = attrs_json()
_CLOSING_SPAN_S = 0.001  # the process's CPU clock resolves far less; the host's ticks don't
_LIMIT_EVERY = 10  # host.memory.limit is required each second: every 0.5 s leaves room for stalls


class HostSampler(Sampler):
    """CPU utilization of this process and the host, RSS, host memory and memory pressure.

    `memory_pressure` is emitted here only when the job trains on CPU; on CUDA the allocator
    sampler owns `trainspec.memory.pressure` (reserved against the device limit).
    """

    name = "host"

    def __init__(self, *, interval_s: float = 0.05, memory_pressure: bool = True) -> None:
        self.interval_s = interval_s
        self.memory_pressure = memory_pressure
        self._counters: HostCounterSource = open_host_counters()
        self._cores = psutil.cpu_count(logical=True) or 1
        self._last_wall: float | None = None
        self._last: HostCounters | None = None
        self._n = 0
        self._rated = False  # a utilization reading was made

    def sample(self, now: float) -> list[Reading]:
        c = self._counters.read()
        out = self._rates(c, now)
        self._last_wall, self._last = now, c
        used = c.memory_total - c.memory_available
        out.append(("trainspec.process.memory.rss", c.process_rss, _NO_ATTRS))
        out.append(("trainspec.host.memory.used", used, _NO_ATTRS))
        if self._n % _LIMIT_EVERY == 0:
            out.append(("trainspec.host.memory.limit", c.memory_total, _NO_ATTRS))
        if self.memory_pressure:
            out.append(("trainspec.memory.pressure", used / c.memory_total, _NO_ATTRS))
        self._n += 1
        return out

    def closing_readings(self, now: float) -> list[Reading]:
        """The utilization of a collector that closes before its second tick (a short single
        process run had none, and failed `required`), over the time since the first reading.
        The process's share is exact (its CPU clock); the host's counts /proc's 10 ms ticks,
        so over a few ms it is coarse, and absent when no tick passed. Rates only: the first
        tick's memory readings stand, and it is the sampler's first rate, so no two rates sit
        closer than the cadence allows; a session that starts next on this rank (the
        zero-code layer hands over to a script's own) makes its first rate an interval after
        its start."""
        if self._rated or self._last_wall is None or now - self._last_wall < _CLOSING_SPAN_S:
            return []
        return self._rates(self._counters.read(), now)

    def _rates(self, c: HostCounters, now: float) -> list[Reading]:
        out: list[Reading] = []
        last = self._last
        if self._last_wall is None or now <= self._last_wall or last is None:
            return out
        wall = now - self._last_wall
        util = (c.process_cpu_s - last.process_cpu_s) / (wall * self._cores)
        out.append(("trainspec.process.cpu.utilization", min(max(util, 0.0), 1.0), _NO_ATTRS))
        busy = c.host_busy_s - last.host_busy_s
        total = c.host_total_s - last.host_total_s
        if total > 0:
            out.append(
                ("trainspec.host.cpu.utilization", min(max(busy / total, 0.0), 1.0), _NO_ATTRS)
            )
        self._rated = True
        return out

    def close(self) -> None:
        self._counters.close()
