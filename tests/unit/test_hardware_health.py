"""Hardware health: sampler readings -> faults -> FLAG_HARDWARE at the step boundary."""

from __future__ import annotations

import time

from trainspec.actuator.hardware import HardwareHealthWatch
from trainspec.collector.collector import Collector
from trainspec.collector.records import attrs_json
from trainspec.collector.sampler import Sampler
from trainspec.collector.sinks.memory import InMemorySink

GPU0 = attrs_json({"gpu.index": 0, "hw.id": "GPU-a"})
GPU1 = attrs_json({"gpu.index": 1, "hw.id": "GPU-b"})
ECC = "trainspec.gpu.errors.ecc"
THROTTLE = "trainspec.gpu.throttle_reasons"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_rising_error_counter_is_a_fault_and_what_was_there_before_is_not():
    watch = HardwareHealthWatch()
    watch.observe([(ECC, 3.0, GPU0), (ECC, 0.0, GPU1)])  # GPU 0 had 3 before the job
    watch.observe([(ECC, 3.0, GPU0), (ECC, 0.0, GPU1)])
    assert watch.take() == []
    watch.observe([(ECC, 3.0, GPU0), (ECC, 2.0, GPU1)])
    (fault,) = watch.take()
    assert (fault.gpu, fault.kind) == ("1", "ecc")
    assert fault.evidence["before"] == 0.0 and fault.evidence["after"] == 2.0
    assert "GPU 1" in fault.reason and "ECC" in fault.reason
    assert watch.take() == []  # taken once
    watch.observe([("trainspec.gpu.errors.remapped_rows", 0.0, GPU0)])
    watch.observe([("trainspec.gpu.errors.remapped_rows", 1.0, GPU0)])
    watch.observe(
        [("trainspec.gpu.errors.xid", 0.0, GPU0), ("trainspec.gpu.errors.xid", 1.0, GPU0)]
    )
    assert [f.kind for f in watch.take()] == ["remapped_rows", "xid"]


def test_thermal_throttling_is_reported_when_it_starts_and_rearmed_after_a_clear_spell():
    clock = Clock()
    watch = HardwareHealthWatch(rearm_s=30.0, clock=clock)
    watch.observe([(THROTTLE, 0x1 | 0x4, GPU0)])  # idle and power cap: not health faults
    assert watch.take() == []
    clock.now = 1.0
    watch.observe([(THROTTLE, 0x40, GPU0)])  # HW thermal slowdown
    (fault,) = watch.take()
    assert fault.kind == "thermal" and fault.evidence["reasons"] == 0x40
    for t, reasons in ((2.0, 0x40), (3.0, 0x0), (20.0, 0x20)):  # on, off 17 s, on again
        clock.now = t
        watch.observe([(THROTTLE, reasons, GPU0)])
    assert watch.take() == []  # one episode: not re-armed after 17 s
    clock.now = 21.0
    watch.observe([(THROTTLE, 0x0, GPU0)])
    clock.now = 52.0
    watch.observe([(THROTTLE, 0x0, GPU0)])  # clear for 31 s: re-armed
    watch.observe([(THROTTLE, 0x8, GPU0)])
    assert [f.kind for f in watch.take()] == ["thermal"]


class Scripted(Sampler):
    """Hands out a fixed list of reading batches, one per tick."""

    name = "scripted"
    interval_s = 0.01

    def __init__(self, batches):
        self.batches = list(batches)

    def sample(self, now):
        return self.batches.pop(0) if self.batches else []


def test_the_collector_feeds_every_reading_to_a_tap_and_drops_a_failing_one():
    watch = HardwareHealthWatch()
    calls = []

    def broken(readings):
        calls.append(len(readings))
        raise RuntimeError("tap bug")

    c = Collector(rank=0, samplers=[Scripted([[(ECC, 0.0, GPU0)], [(ECC, 1.0, GPU0)]])],
                  sinks=[InMemorySink()])  # fmt: skip
    c.add_tap(broken)
    c.add_tap(watch.observe)
    c.start()
    deadline = time.monotonic() + 5
    faults = []
    while not faults and time.monotonic() < deadline:
        faults = watch.take()
        time.sleep(0.01)
    c.close()
    assert [f.kind for f in faults] == ["ecc"]
    assert calls == [1]  # the failing tap ran once, then was taken off


class FakeNvml:
    """The slice of nvidia-ml-py the sampler and the Xid events use, with scripted faults."""

    NVML_ERROR_TIMEOUT = 10
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        self.ecc = 0
        self.throttle = 0
        self.xids: list[int] = []
        self.freed = 0
        self.lost = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-fake"

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 80 << 30, "used": 1 << 30})()

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("Util", (), {"gpu": 50, "memory": 20})()

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.throttle

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self.ecc

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, kinds, event_set):
        assert kinds == self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0  # never waits on the sampling thread
        if self.lost:
            raise self.NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        if not self.xids:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        xid = self.xids.pop(0)
        return type("Event", (), {"eventType": 0x8, "eventData": xid})()

    def nvmlEventSetFree(self, event_set):
        self.freed += 1


def test_nvml_readings_of_a_failing_gpu_reach_the_watch(monkeypatch):
    import sys

    from trainspec.collector.samplers.nvml import NvmlSampler

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler(["0"])
    assert sampler.unavailable_reason() is None
    watch = HardwareHealthWatch()

    def slow_tick() -> list:
        readings = []
        for _ in range(10):  # the errors and Xid counts are read every tenth tick
            readings += sampler.sample(0.0)
        watch.observe(readings)
        return readings

    first = slow_tick()
    assert ("trainspec.gpu.errors.xid", 0.0) in [(m, v) for m, v, _ in first]
    assert watch.take() == []
    fake.ecc, fake.xids, fake.throttle = 2, [45, 79], 0x40  # 45: an app's cleanup, not counted
    readings = slow_tick()
    assert ("trainspec.gpu.errors.xid", 1.0) in [(m, v) for m, v, _ in readings]
    assert sorted(f.kind for f in watch.take()) == ["ecc", "thermal", "xid"]
    fake.lost = True  # the GPU fell off the bus: the wait fails for good
    assert "trainspec.gpu.errors.xid" not in [m for m, _, _ in slow_tick()]  # said once, then off
    assert fake.freed == 1  # its event set released at once
    sampler.close()


def test_a_tap_removed_by_the_other_lane_while_failing_does_not_kill_this_one():
    c = Collector(rank=0, samplers=[], sinks=[InMemorySink()])

    def failing(readings):
        c._taps.remove(failing)  # as if the other sampling thread got there first
        raise RuntimeError("tap bug")

    c.add_tap(failing)
    c._run_sampler(Scripted([[(ECC, 0.0, GPU0)]]), 0.0)  # must not raise ValueError
    assert c._taps == []
    c.close()


def test_a_failing_sampler_is_closed_when_taken_off():
    closed = []

    class Broken(Scripted):
        def sample(self, now):
            raise OSError("device gone")

        def close(self):
            closed.append(True)

    broken = Broken([])
    c = Collector(rank=0, samplers=[broken], sinks=[InMemorySink()])
    c._run_sampler(broken, 0.0)
    assert closed == [True] and "failed" in c.unavailable["scripted"]
    c.close()


def test_staged_ecc_errors_each_rise_the_count():
    from types import SimpleNamespace

    from trainspec.runtime.hardware_health import attach_hardware_health
    from trainspec.runtime.inject import FaultPlan, Injector

    flags, events = [], []
    session = SimpleNamespace(
        collector=Collector(rank=0, samplers=[], sinks=[InMemorySink()]),
        boundary_hooks=[],
        event=lambda *a, **kw: events.append(a),
    )
    controller = SimpleNamespace(raise_flag=flags.append)
    plan = FaultPlan.parse("ecc:rank=0,step=3;ecc:rank=0,step=7")
    attach_hardware_health(session, controller, Injector(plan, rank=0, attempt=0))
    (hook,) = session.boundary_hooks
    for steps_done in range(1, 11):
        hook(steps_done)
    assert len(flags) == 2 and [e[1] for e in events] == ["hardware", "hardware"]
    assert "from 1 to 2" in events[1][2]
    session.collector.close()
