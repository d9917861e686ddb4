"""Host counters: the /proc reader parses proc(5) text and agrees with psutil on this host."""

from __future__ import annotations

import os
import sys
import time

import pytest

from trainspec.collector.samplers import host_readings
from trainspec.collector.samplers.host_readings import (
    ProcfsCounters,
    PsutilCounters,
    open_host_counters,
    parse_procfs,
)

# A command name with spaces and a ") " inside it: the parser must split after the last ")".
PROC_STAT = (
    b"4242 (py ) (x) S 1 4242 4242 0 -1 4194304 9000 0 0 0 "
    b"250 50 0 0 20 0 7 0 1234 987654321 3000 18446744073709551615 0 0 0 0\n"
)
HOST_STAT = b"cpu  100 10 40 800 50 5 5 0 30 0\ncpu0 50 5 20 400 25 2 3 0 15 0\nintr 1 2 3\n"
MEMINFO = b"MemTotal:       2000 kB\nMemFree:         500 kB\nMemAvailable:    1500 kB\n"


def test_parse_procfs_reads_the_fields_proc5_names():
    c = parse_procfs(
        PROC_STAT, HOST_STAT, MEMINFO, clock_tick=100.0, page_size=4096.0, process_cpu_s=7.5
    )
    assert c.process_cpu_s == 7.5  # the process's own clock, not the 10 ms ticks
    assert c.process_rss == 3000 * 4096.0
    # user..steal = 1010 ticks (guest 30 is inside user already); idle + iowait = 850.
    assert c.host_total_s == pytest.approx(10.10)
    assert c.host_busy_s == pytest.approx(1.60)
    assert (c.memory_total, c.memory_available) == (2000 * 1024.0, 1500 * 1024.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_procfs_reader_agrees_with_psutil_here():
    fast, portable = ProcfsCounters(), PsutilCounters()
    try:
        a, b = fast.read(), portable.read()
    finally:
        fast.close()
    chosen = open_host_counters()
    chosen.close()
    assert isinstance(chosen, ProcfsCounters)
    assert abs(a.process_cpu_s - b.process_cpu_s) <= 0.05
    assert abs(a.process_rss - b.process_rss) <= 16 * 2**20
    assert a.memory_total == b.memory_total
    assert abs(a.memory_available - b.memory_available) <= 0.05 * b.memory_total
    assert abs(a.host_total_s - b.host_total_s) <= 0.01 * b.host_total_s
    assert 0.0 <= a.host_busy_s <= a.host_total_s


def test_unreadable_proc_falls_back_to_psutil(monkeypatch):
    def refuse(path, flags, *args):
        raise PermissionError(13, "denied", path)

    monkeypatch.setattr(host_readings.os, "open", refuse)
    source = open_host_counters()
    assert isinstance(source, PsutilCounters)
    assert source.read().memory_total > 0


def test_a_proc_without_memavailable_falls_back_to_psutil(monkeypatch):
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc here")
    real = host_readings.os.pread

    def old_kernel(fd, n, offset):
        text = real(fd, n, offset)
        return text.replace(b"MemAvailable:", b"MemSomethingElse:")

    monkeypatch.setattr(host_readings.os, "pread", old_kernel)
    assert isinstance(open_host_counters(), PsutilCounters)


@pytest.mark.parametrize("reader", [ProcfsCounters, PsutilCounters])
def test_process_cpu_time_resolves_less_than_a_10_ms_tick(reader):
    """/proc's utime and stime count 10 ms ticks: 2 ms of work read as 0 or 10 ms, and a run
    within one tick had no CPU utilization. The process's own clock sees the 2 ms."""
    if reader is ProcfsCounters and not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    source = reader()
    try:
        before = source.read().process_cpu_s
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        spent = source.read().process_cpu_s - before
    finally:
        source.close()
    assert 0.0019 <= spent < 0.009, spent
