"""Process and host CPU and memory counters, read as cheaply as the platform allows.

On Linux three `pread`s of files opened once (`/proc/self/stat`, `/proc/stat`,
`/proc/meminfo`) give everything the host sampler needs. psutil reads the same files but
opens and parses each one per call: at a 50 ms cadence, on a thread that wakes with cold
caches, that measured about 0.3 ms per tick against about 0.1 ms for the three reads
(docs/collector.md#overhead). Elsewhere, or where /proc cannot be read, psutil is used.

The process's CPU time comes from its own CPU clock (`time.process_time`, every thread,
nanoseconds) on both paths: /proc's utime and stime (and psutil's, read from them) count
10 ms ticks, 20% of a core over a 50 ms interval, and nothing at all over a run that ends
within one tick.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Protocol

import psutil


@dataclass(frozen=True)
class HostCounters:
    """One reading. CPU times are cumulative seconds; memory is bytes. `process_cpu_s` is
    this process's CPU clock; the host's times are /proc's 10 ms ticks."""

    process_cpu_s: float
    process_rss: float
    host_busy_s: float
    host_total_s: float
    memory_total: float
    memory_available: float


class HostCounterSource(Protocol):
    def read(self) -> HostCounters: ...

    def close(self) -> None: ...


class PsutilCounters:
    """Portable: psutil's per-call reads."""

    def __init__(self) -> None:
        self._proc = psutil.Process(os.getpid())

    def read(self) -> HostCounters:
        host = psutil.cpu_times()
        idle = host.idle + getattr(host, "iowait", 0.0)
        total = sum(host)
        vm = psutil.virtual_memory()
        return HostCounters(
            process_cpu_s=time.process_time(),
            process_rss=float(self._proc.memory_info().rss),
            host_busy_s=total - idle,
            host_total_s=total,
            memory_total=float(vm.total),
            memory_available=float(vm.available),
        )

    def close(self) -> None:
        pass


def parse_procfs(
    proc_stat: bytes,
    host_stat: bytes,
    meminfo: bytes,
    *,
    clock_tick: float,
    page_size: float,
    process_cpu_s: float,
) -> HostCounters:
    """Counters from the text of /proc/self/stat, /proc/stat and /proc/meminfo (proc(5)),
    with the process's CPU time read from its own clock."""
    # The fields after the command name, which may itself hold spaces and parentheses.
    fields = proc_stat[proc_stat.rindex(b")") + 2 :].split()
    # rss (pages) is field 24 of /proc/pid/stat; here from 3.
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice.
    # guest time is already counted in user (guest_nice in nice), so only the first 8.
    cpu = [int(x) for x in host_stat[: host_stat.index(b"\n")].split()[1:9]]
    total = sum(cpu) / clock_tick
    return HostCounters(
        process_cpu_s=process_cpu_s,
        process_rss=int(fields[21]) * page_size,
        host_busy_s=total - (cpu[3] + cpu[4]) / clock_tick,
        host_total_s=total,
        memory_total=_meminfo_bytes(meminfo, b"MemTotal:"),
        memory_available=_meminfo_bytes(meminfo, b"MemAvailable:"),
    )


class ProcfsCounters:
    """Linux: the three /proc files, kept open and re-read from offset 0 each time."""

    def __init__(self) -> None:
        self._tick = float(os.sysconf("SC_CLK_TCK"))
        self._page = float(os.sysconf("SC_PAGE_SIZE"))
        self._fds: list[int] = []
        try:
            for path in ("/proc/self/stat", "/proc/stat", "/proc/meminfo"):
                self._fds.append(os.open(path, os.O_RDONLY))
        except OSError:
            self.close()
            raise

    def read(self) -> HostCounters:
        proc, host, mem = (os.pread(fd, 4096, 0) for fd in self._fds)
        return parse_procfs(
            proc,
            host,
            mem,
            clock_tick=self._tick,
            page_size=self._page,
            process_cpu_s=time.process_time(),
        )

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _meminfo_bytes(text: bytes, key: bytes) -> float:
    start = text.index(key) + len(key)
    return float(int(text[start : text.index(b"kB", start)]) * 1024)


def open_host_counters() -> HostCounterSource:
    """The /proc reader where it works (checked by one read), else psutil."""
    try:
        source = ProcfsCounters()
    except OSError:
        return PsutilCounters()
    try:
        source.read()
    except (OSError, ValueError, IndexError):
        source.close()
        return PsutilCounters()
    return source
