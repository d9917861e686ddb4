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

    def sample(self, now: float) -> list[Reading]:
        out: list[Reading] = []
        c = self._counters.read()
        last = self._last
        if self._last_wall is not None and now > self._last_wall and last is not None:
            wall = now - self._last_wall
            util = (c.process_cpu_s - last.process_cpu_s) / (wall * self._cores)
            out.append(("trainspec.process.cpu.utilization", min(max(util, 0.0), 1.0), _NO_ATTRS))
            busy = c.host_busy_s - last.host_busy_s
            total = c.host_total_s - last.host_total_s
            if total > 0:
                out.append(
                    ("trainspec.host.cpu.utilization", min(max(busy / total, 0.0), 1.0), _NO_ATTRS)
                )
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

    def close(self) -> None:
        self._counters.close()
