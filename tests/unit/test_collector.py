from __future__ import annotations

import os
import threading
import time

import pytest

from trainspec.collector import Collector, StepRecord
from trainspec.collector.records import attrs_json
from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.host import HostSampler
from trainspec.collector.samplers.nvml import NvmlSampler, visible_nvml_indices
from trainspec.collector.samplers.telemetry import TelemetrySampler
from trainspec.collector.sink import Sink
from trainspec.collector.sinks.memory import InMemorySink


class CountingSampler(Sampler):
    name = "counting"

    def __init__(self, interval_s: float, per_call: int = 1) -> None:
        self.interval_s = interval_s
        self.per_call = per_call
        self.calls = 0

    def sample(self, now):
        self.calls += 1
        return [("trainspec.memory.pressure", 0.5, attrs_json())] * self.per_call


class BrokenSampler(Sampler):
    name = "broken"

    def sample(self, now):
        raise RuntimeError("sensor fell off")


class BrokenSink(Sink):
    name = "broken"

    def write(self, batch):
        raise OSError("disk full")


class SlowSink(Sink):
    name = "slow"

    def write(self, batch):
        time.sleep(0.5)


def test_samples_on_their_interval():
    sink = InMemorySink()
    fast, slow = CountingSampler(0.05), CountingSampler(0.25)
    c = Collector(rank=0, samplers=[fast, slow], sinks=[sink], flush_interval_s=0.2).start()
    time.sleep(1.0)
    c.close()
    assert 14 <= fast.calls <= 23  # ~20 at 50 ms, tolerant of a loaded 2-core machine
    assert 3 <= slow.calls <= 6
    ts = sorted(sink.samples()["ts"].to_pylist())
    assert len(ts) == fast.calls + slow.calls


def test_full_buffer_drops_and_counts_instead_of_blocking():
    sink = InMemorySink()
    c = Collector(
        rank=0,
        samplers=[CountingSampler(0.01, per_call=50)],
        sinks=[sink],
        flush_interval_s=10,
        capacity=100,
    )
    c.start()
    time.sleep(0.3)
    c.close()
    assert sink.samples().num_rows == 100
    assert c.dropped_total() > 0
    telemetry = TelemetrySampler(c.dropped_total)
    assert telemetry.sample(time.time())[0][1] == c.dropped_total()


def test_record_step_never_blocks_and_counts_overflow():
    c = Collector(rank=0, samplers=[], sinks=[InMemorySink()], capacity=10)
    t0 = time.perf_counter()
    for i in range(1000):
        c.record_step(StepRecord(ts=0.0, rank=0, step=i, duration_s=0.1))
    assert time.perf_counter() - t0 < 0.5
    assert c.dropped["queue"] == 990
    c.close()


def test_failing_sampler_is_disabled_and_others_go_on():
    sink = InMemorySink()
    good = CountingSampler(0.05)
    c = Collector(
        rank=0, samplers=[BrokenSampler(), good], sinks=[sink], flush_interval_s=0.1
    ).start()
    time.sleep(0.3)
    c.close()
    assert "broken" in c.unavailable and "sensor fell off" in c.unavailable["broken"]
    assert good.calls > 2


def test_failing_sink_is_contained_and_counted():
    good = InMemorySink()
    c = Collector(
        rank=0, samplers=[CountingSampler(0.05)], sinks=[BrokenSink(), good], flush_interval_s=0.1
    )
    c.start()
    time.sleep(0.35)
    c.close()
    assert c.sink_errors["broken"] >= 1
    assert c.dropped["broken"] > 0
    assert good.samples().num_rows > 0


def test_slow_sink_does_not_delay_the_training_thread():
    c = Collector(
        rank=0, samplers=[CountingSampler(0.01)], sinks=[SlowSink()], flush_interval_s=0.05
    )
    c.start()
    worst = 0.0
    for i in range(200):
        t0 = time.perf_counter()
        c.record_step(StepRecord(ts=0.0, rank=0, step=i, duration_s=0.1))
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.002)
    c.close(timeout_s=2)
    assert worst < 0.05


def test_close_is_idempotent_and_threads_stop():
    sink = InMemorySink()
    c = Collector(rank=0, samplers=[CountingSampler(0.05)], sinks=[sink]).start()
    c.close()
    c.close()
    assert sink.closed == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("trainspec-")]


def test_host_sampler_values_in_range():
    s = HostSampler()
    s.sample(time.time())
    time.sleep(0.06)
    readings = {m: v for m, v, _ in s.sample(time.time())}
    assert 0.0 <= readings["trainspec.process.cpu.utilization"] <= 1.0
    assert 0.0 <= readings["trainspec.memory.pressure"] <= 1.0
    assert readings["trainspec.process.memory.rss"] > 1e6


def test_nvml_reports_unavailable_once_without_gpu():
    c = Collector(
        rank=0, samplers=[NvmlSampler(["0"]), CountingSampler(0.05)], sinks=[InMemorySink()]
    )
    reason = c.unavailable.get("nvml")
    if reason is None:
        pytest.skip("this machine has an NVIDIA GPU")
    assert "NVML" in reason or "nvidia-ml-py" in reason
    assert [s.name for s in c.samplers] == ["counting"]
    c.close()


@pytest.mark.parametrize(
    "env, local_rank, expected",
    [
        ({}, 1, ["1"]),
        ({"CUDA_VISIBLE_DEVICES": "3,5"}, 1, ["5"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, 0, ["GPU-a"]),
        ({}, None, ["*"]),
    ],
)
def test_visible_gpus_follow_cuda_visible_devices(env, local_rank, expected):
    assert visible_nvml_indices(local_rank, env) == expected


def test_visible_gpus_refuse_a_rank_beyond_the_list():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        visible_nvml_indices(2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_peak_flops_known_gpus_and_unknown_devices():
    from trainspec.collector.peak_flops import peak_flops_for

    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops_for("cpu") is None


class NicenessSampler(Sampler):
    """Records the nice value of the thread that samples it."""

    def __init__(self, name: str, dedicated: bool) -> None:
        self.name = name
        self.times_peers = dedicated
        self.interval_s = 0.05
        self.nice: int | None = None

    def sample(self, now):
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return []


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is POSIX")
def test_shared_sampler_and_flush_threads_yield_to_training_but_probe_lane_does_not():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if base > 19 - 5:
        pytest.skip(f"this process already runs at nice {base}")
    shared, own = NicenessSampler("shared", False), NicenessSampler("own", True)
    flush_nice: list[int] = []

    class NiceSink(Sink):
        name = "nice"

        def write(self, batch):
            flush_nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    c = Collector(
        rank=0, samplers=[shared, own], sinks=[NiceSink()], flush_interval_s=0.1, thread_nice=5
    ).start()
    c.record_step(StepRecord(ts=time.time(), rank=0, step=0, duration_s=0.1))
    time.sleep(0.4)
    c.close()
    assert shared.nice == base + 5
    assert own.nice == base  # the latency probe times other ranks: no added scheduling delay
    assert flush_nice and flush_nice[0] == base + 5
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # caller untouched


class ThreadRecordingSampler(Sampler):
    """Records the thread that samples it, and the order of calls within a tick."""

    def __init__(self, name: str, times_peers: bool, calls: list[str]) -> None:
        self.name = name
        self.times_peers = times_peers
        self.interval_s = 0.05
        self.calls = calls
        self.threads: set[int] = set()

    def sample(self, now):
        self.threads.add(threading.get_native_id())
        self.calls.append(self.name)
        return []


def test_at_nice_zero_one_thread_samples_everything_the_probe_first():
    """The probe shares the sampling thread unless that thread is niced: one wake-up per
    tick, not two (its own thread until 2026-11-25)."""
    calls: list[str] = []
    host = ThreadRecordingSampler("host", False, calls)
    probe = ThreadRecordingSampler("probe", True, calls)
    c = Collector(rank=0, samplers=[host, probe], sinks=[InMemorySink()]).start()
    time.sleep(0.3)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("trainspec-"))
    c.close()
    assert names == ["trainspec-flush", "trainspec-sampler"]
    assert host.threads == probe.threads and len(host.threads) == 1
    assert calls[:4] == ["probe", "host", "probe", "host"]


def test_thread_nice_zero_leaves_priorities_alone():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    shared = NicenessSampler("shared", False)
    c = Collector(rank=0, samplers=[shared], sinks=[InMemorySink()]).start()
    time.sleep(0.2)
    c.close()
    assert shared.nice == base


def test_a_late_tick_does_not_bunch_the_next_reading():
    from trainspec.collector.collector import _next_due

    # On time: the next point of the grid.
    assert _next_due(1.00, 1.00, 0.05) == pytest.approx(1.05)
    # 20 ms late: the next grid point is still 30 ms away, kept.
    assert _next_due(1.00, 1.02, 0.05) == pytest.approx(1.05)
    # 40 ms late: the next grid point would be 10 ms after this reading; skipped.
    assert _next_due(1.00, 1.04, 0.05) == pytest.approx(1.10)
    # A 1 s stall: the grid holds, the next point at least half an interval away.
    assert _next_due(1.00, 2.013, 0.05) == pytest.approx(2.05)
    assert _next_due(1.00, 2.03, 0.05) == pytest.approx(2.10)


def test_readings_stay_half_an_interval_apart_when_ticks_wake_late():
    """The sampling thread is late (a loaded machine): no two readings closer than half the
    interval (they were 10 ms apart after a tick 40 ms late)."""
    stamps: list[float] = []

    class Slow(Sampler):
        name = "slow"
        interval_s = 0.05

        def __init__(self) -> None:
            self.n = 0

        def sample(self, now: float):
            stamps.append(time.monotonic())
            self.n += 1
            if self.n % 3 == 1:
                time.sleep(0.09)  # the next tick wakes 40 ms after its time
            return []

    collector = Collector(rank=0, samplers=[Slow()], sinks=[], flush_interval_s=60).start()
    time.sleep(1.0)
    collector.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= 10
    assert min(gaps) >= 0.025 - 0.002, gaps


def test_a_collector_closed_before_its_second_tick_still_has_the_host_cpu_utilization():
    """A rate needs two readings: a single process's run shorter than one interval had no CPU
    utilization at all and failed `required`. The host sampler makes its first rate at close,
    and only the rates: no memory reading twice."""
    sink = InMemorySink()
    c = Collector(rank=0, samplers=[HostSampler()], sinks=[sink], flush_interval_s=60).start()
    time.sleep(0.02)  # before the second 50 ms tick
    c.close()
    names = sink.samples().column("metric").to_pylist()
    assert names.count("trainspec.process.cpu.utilization") == 1, names
    assert names.count("trainspec.host.memory.used") == 1, names


def test_no_closing_rate_within_half_an_interval_or_after_a_rate():
    """Within a millisecond of the first reading: nothing. After a tick's rate: nothing
    more."""
    sampler = HostSampler(interval_s=0.05)
    sampler.sample(100.0)
    assert sampler.closing_readings(100.0005) == []
    names = [r[0] for r in sampler.closing_readings(100.02)]
    assert "trainspec.process.cpu.utilization" in names
    assert "trainspec.host.memory.used" not in names
    assert sampler.closing_readings(100.06) == []
    fresh = HostSampler(interval_s=0.05)
    fresh.sample(100.0)
    fresh.sample(100.05)
    assert fresh.closing_readings(100.09) == []
    sampler.close()
    fresh.close()


def test_the_agent_s_node_sampler_sends_no_process_reading_at_close_either():
    """The process fields would describe the agent itself: filtered from each tick, and now
    from the rate made at close."""
    from trainspec.agent.node import NodeHostSampler

    node, plain = NodeHostSampler(interval_s=0.05), HostSampler(interval_s=0.05)
    first = [r[0] for r in node.sample(100.0)]
    plain.sample(100.0)
    time.sleep(0.03)  # a CPU clock tick or more for the host's counters
    closing = [r[0] for r in node.closing_readings(100.03)]
    assert "trainspec.process.cpu.utilization" in [r[0] for r in plain.closing_readings(100.03)]
    node.close()
    plain.close()
    assert first and not [n for n in first + closing if n.startswith("trainspec.process.")]


def _dropped_readings(sink: InMemorySink) -> list[float]:
    samples = sink.samples()
    return [
        v
        for m, v in zip(samples["metric"].to_pylist(), samples["value"].to_pylist(), strict=True)
        if m == "trainspec.telemetry.dropped"
    ]


def test_the_drop_counter_is_not_dropped_by_the_full_queue_it_counts():
    """Capacity 5, a sampler that overflows it every tick: the drop counter's readings still
    reach every flush (they went into the same full queue and were dropped with it, so the
    exporters read 0 while 783 points were lost), one slot per flush, its latest reading."""
    sink = InMemorySink()
    c = Collector(rank=0, samplers=[], sinks=[sink], flush_interval_s=3600, capacity=5)
    telemetry = TelemetrySampler(c.dropped_total)
    flood = CountingSampler(0.05, per_call=10)
    c.samplers = [flood, telemetry]
    for _ in range(3):
        c._run_sampler(flood, time.time())
        c._run_sampler(telemetry, time.time())
    c.flush()
    assert _dropped_readings(sink) == [25.0]  # 5 + 10 + 10 overflowed, its latest reading
    assert len(sink.batches[0].samples) == 6  # the capacity and the counter's one slot
    c._run_sampler(flood, time.time())
    c._run_sampler(telemetry, time.time())
    c.flush()
    assert _dropped_readings(sink) == [25.0, 30.0]
    c.close()


def test_the_final_drop_count_reaches_the_exporters_before_they_close():
    """A non-durable sink (Prometheus, OTLP) is closed before the store: the final reading
    of the drop counter used to be taken after that, so they never saw it."""

    class Exporter(InMemorySink):
        name = "exporter"

        def write(self, batch):
            assert not self.closed, "written after close"
            super().write(batch)

    exporter, store = Exporter(), InMemorySink()
    store.durable = True
    c = Collector(rank=0, samplers=[], sinks=[exporter, store], flush_interval_s=3600, capacity=3)
    c.samplers = [TelemetrySampler(c.dropped_total)]  # not started: only the close reads it
    for i in range(10):
        c.record_step(StepRecord(ts=0.0, rank=0, step=i, duration_s=0.1))
    c.close()
    assert c.dropped_total() == 7
    assert _dropped_readings(exporter)[-1] == 7.0
    assert _dropped_readings(store)[-1] == 7.0


class _Stall(Sampler):
    """First in the lane (as the probe is): its tenth reading stalls the thread 120 ms."""

    name = "stall"
    interval_s = 0.05

    def __init__(self) -> None:
        self.n = 0

    def sample(self, now: float):
        self.n += 1
        if self.n == 10:
            time.sleep(0.12)
        return []


class _Stamps(Sampler):
    name = "stamps"
    interval_s = 0.05

    def __init__(self) -> None:
        self.mono: list[float] = []
        self.wall: list[float] = []

    def sample(self, now: float):
        self.mono.append(time.monotonic())
        self.wall.append(now)
        return []


def test_a_stall_leaves_no_burst_of_readings_behind_it():
    """After a 120 ms stall of the sampler before it, a sampler read 0.1 ms after its last
    reading (the loop ran the missed ticks at once, with clocks read before the stall)."""
    stamps = _Stamps()
    c = Collector(rank=0, samplers=[_Stall(), stamps], sinks=[], flush_interval_s=60).start()
    time.sleep(1.0)
    c.close()
    gaps = [b - a for a, b in zip(stamps.mono, stamps.mono[1:])]
    assert len(stamps.mono) >= 10
    assert max(gaps) >= 0.1  # the stall happened
    assert min(gaps) >= 0.025 - 0.002, gaps
    # Each sampler's wall clock is read as it runs: not before the stall.
    late = [w - m for w, m in zip(stamps.wall, stamps.mono)]
    assert max(late) - min(late) < 0.02, late
