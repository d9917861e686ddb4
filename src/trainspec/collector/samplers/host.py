"""Process and host CPU and memory through psutil: the utilization family for CPU training."""

from __future__ import annotations

import os

import psutil

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler

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
        self._proc = psutil.Process(os.getpid())
        self._cores = psutil.cpu_count(logical=True) or 1
        self._last_wall: float | None = None
        self._last_proc = 0.0
        self._last_host: tuple[float, float] | None = None
        self._n = 0

    @staticmethod
    def _host_busy_total() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t)
        return total - idle, total

    def sample(self, now: float) -> list[Reading]:
        out: list[Reading] = []
        times = self._proc.cpu_times()
        proc_cpu = times.user + times.system
        host = self._host_busy_total()
        if self._last_wall is not None and now > self._last_wall and self._last_host is not None:
            wall = now - self._last_wall
            util = (proc_cpu - self._last_proc) / (wall * self._cores)
            out.append(("trainspec.process.cpu.utilization", min(max(util, 0.0), 1.0), _NO_ATTRS))
            busy = host[0] - self._last_host[0]
            total = host[1] - self._last_host[1]
            if total > 0:
                out.append(
                    ("trainspec.host.cpu.utilization", min(max(busy / total, 0.0), 1.0), _NO_ATTRS)
                )
        self._last_wall, self._last_proc, self._last_host = now, proc_cpu, host
        vm = psutil.virtual_memory()
        used = vm.total - vm.available
        out.append(("trainspec.process.memory.rss", float(self._proc.memory_info().rss), _NO_ATTRS))
        out.append(("trainspec.host.memory.used", float(used), _NO_ATTRS))
        if self._n % _LIMIT_EVERY == 0:
            out.append(("trainspec.host.memory.limit", float(vm.total), _NO_ATTRS))
        if self.memory_pressure:
            out.append(("trainspec.memory.pressure", used / vm.total, _NO_ATTRS))
        self._n += 1
        return out
