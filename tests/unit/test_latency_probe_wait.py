"""The probe's waiter: bounded native waits, a deadline that holds, a close that stops it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from trainspec.collector.samplers.latency import (
    LAGS,
    WAIT_SLICE_S,
    LatencyProbeSampler,
    _Probe,
)
from trainspec.collector.samplers.probe_ledger import UNKNOWN


def probe(index: int, work: object) -> _Probe:
    payload = torch.full((LAGS,), UNKNOWN, dtype=torch.float64)
    return _Probe(index, float(index), time.perf_counter(), work, payload)


class NeverDone:
    """A collective whose peer never arrives. A timeout of 0 ms is torch's 'no timeout':
    a real wait would then never return, so it is recorded and refused here."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def wait(self, timeout: timedelta) -> bool:
        ms = timeout / timedelta(milliseconds=1)
        self.timeouts.append(ms)
        if int(ms) <= 0:
            raise AssertionError("a 0 ms wait: torch would wait forever")
        time.sleep(ms / 1000.0)
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


class Failed(NeverDone):
    def wait(self, timeout: timedelta) -> bool:
        raise RuntimeError("Connection closed by peer")

    def is_completed(self) -> bool:
        return True


def test_a_probe_that_never_completes_times_out_by_its_deadline_in_short_waits():
    sampler = LatencyProbeSampler(group=None, timeout_s=0.3)
    work = NeverDone()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        sampler._wait(work, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 0.3 + WAIT_SLICE_S
    assert all(1.0 <= ms <= WAIT_SLICE_S * 1000 for ms in work.timeouts)
    # The last slice is what was left of the deadline, however little: never 0 ms.
    with pytest.raises(TimeoutError):
        sampler._wait(work, time.monotonic() + 0.0004)


def test_a_failed_collective_raises_its_own_error_at_once():
    sampler = LatencyProbeSampler(group=None, timeout_s=5.0)
    with pytest.raises(RuntimeError, match="closed by peer"):
        sampler._wait(Failed(), time.monotonic() + 5.0)


def test_a_timed_out_probe_marks_the_sampler_failed_and_shutdown_does_not_wait():
    sampler = LatencyProbeSampler(group=None, timeout_s=0.2)
    sampler._outstanding = 1
    sampler._queue.put(probe(1, NeverDone()))
    waiter = threading.Thread(target=sampler._wait_loop, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 5.0
    while not sampler.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler.failed and sampler._outstanding == 0
    t0 = time.monotonic()
    assert sampler.stop_aligned(control_group=None, timeout_s=10.0) is False
    assert time.monotonic() - t0 < 5.0  # not the 10 s wait for an all-reduce that cannot finish
    sampler._waiter = waiter
    sampler.close()
    assert not waiter.is_alive()


def test_close_stops_the_waiter_while_a_probe_is_in_flight():
    sampler = LatencyProbeSampler(group=None, timeout_s=60.0)
    sampler._outstanding = 1
    sampler._queue.put(probe(1, NeverDone()))
    sampler._waiter = threading.Thread(target=sampler._wait_loop, daemon=True)
    sampler._waiter.start()
    time.sleep(0.1)  # inside a wait now
    t0 = time.monotonic()
    sampler.close()
    assert not sampler._waiter.is_alive()
    assert time.monotonic() - t0 < 2 * WAIT_SLICE_S + 0.2


def test_shutdown_alignment_gives_up_when_a_probe_fails_while_it_waits(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: NeverDone())
    sampler = LatencyProbeSampler(group=None, timeout_s=10.0)

    def fail_soon() -> None:
        time.sleep(0.3)
        sampler.failed = True  # as the waiter does when a probe's collective fails

    threading.Thread(target=fail_soon, daemon=True).start()
    t0 = time.monotonic()
    assert sampler.stop_aligned(control_group=None, timeout_s=10.0) is False
    assert time.monotonic() - t0 < 2.0  # not the alignment's 10 s


class DoneJustAfterTheSlice(NeverDone):
    """Completes successfully just after a slice ran out (the slice's wait still raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.done = False

    def wait(self, timeout: timedelta) -> bool:
        if self.done:
            return True
        self.done = True
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.done


def test_a_probe_completing_just_after_a_slice_ran_out_is_a_success():
    sampler = LatencyProbeSampler(group=None, timeout_s=5.0)
    sampler._wait(DoneJustAfterTheSlice(), time.monotonic() + 5.0)  # no error


class Done(NeverDone):
    def wait(self, timeout: timedelta) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_a_later_successful_probe_clears_a_transient_failure():
    sampler = LatencyProbeSampler(group=None, timeout_s=0.2)
    sampler._outstanding = 2
    sampler._queue.put(probe(1, NeverDone()))  # times out: failed
    sampler._queue.put(probe(2, Done()))  # the group answers again
    sampler._waiter = threading.Thread(target=sampler._wait_loop, daemon=True)
    sampler._waiter.start()
    deadline = time.monotonic() + 5.0
    while sampler._outstanding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler._outstanding == 0 and sampler.count == 1
    assert not sampler.failed  # the shutdown alignment will be attempted
    sampler.close()


def test_probes_are_issued_in_the_order_they_are_numbered_when_shutdown_races_a_tick(
    monkeypatch,
):
    """A sampler thread stalled between numbering a probe and issuing it (a starved thread)
    must not let the shutdown alignment issue a later-numbered probe first: gloo pairs
    probes across ranks by issue order, so this rank's probe k + 1 would meet the others' k."""
    import torch.distributed as dist

    issued: list[int] = []  # the number of each probe, in the order its all-reduce was issued
    first = threading.Event()

    def all_reduce(tensor, op=None, group=None, async_op=False):
        tensor.fill_(3)  # the control group's agreement: peers are at 3
        return Done()

    class Group:
        def allreduce(self, tensors, options):
            if not first.is_set():
                first.set()
                time.sleep(0.3)  # the stall, after numbering and before issuing
            issued.append(sampler._launched + 1)  # counted once issued, under the launch lock
            return Done()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    sampler = LatencyProbeSampler(group=Group(), timeout_s=5.0)
    queued: list[int] = []
    inner = sampler._queue

    class Recording:
        def put(self, probe: _Probe) -> None:
            if probe.work is not None:
                queued.append(probe.index)
            inner.put(probe)

        def get(self) -> _Probe:
            return inner.get()

    sampler._queue = Recording()
    tick = threading.Thread(target=sampler.sample, args=(time.time(),), daemon=True)
    tick.start()
    assert first.wait(5.0)
    assert sampler.stop_aligned(control_group=None, timeout_s=5.0) is True
    tick.join(5.0)
    sampler.close()
    assert queued == [1, 2, 3, 4]  # 3 aligned probes and the carrier
    assert issued == queued


class Pending:
    """An all-reduce whose peers answer when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self, timeout: timedelta) -> bool:
        if self.done.wait(timeout / timedelta(seconds=1)):
            return True
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.done.is_set()


def test_at_most_lags_probes_in_flight_each_payload_lags_elements():
    """Peers that have not answered hold back more than LAGS probes; each payload carries
    the durations of the LAGS probes before (one element at LAGS = 1: 3 socket writes a
    probe between two gloo ranks where the 40-element payload before 2026-11-25 made 12)."""
    works: list[Pending] = []
    tensors: list[torch.Tensor] = []

    class Group:
        def allreduce(self, tensors_, options):
            tensors.append(tensors_[0])
            works.append(Pending())
            return works[-1]

    sampler = LatencyProbeSampler(group=Group(), timeout_s=5.0)
    try:
        for k in range(LAGS + 2):
            sampler.sample(1.0 + 0.05 * k)
        assert len(works) == LAGS  # the first ones still run: no more launched
        works[0].done.set()  # the skipped ticks' probe is made up, once
        wait_for(lambda: len(works) == LAGS + 1)
        sampler.sample(1.5)  # the made-up probe still runs: none launched
        assert len(works) == LAGS + 1 and {t.numel() for t in tensors} == {LAGS}
        assert tensors[LAGS].data_ptr() == tensors[0].data_ptr()  # probe 1 was read: reused
    finally:
        for work in works:
            work.done.set()
        sampler.close()


def test_a_probe_abandoned_as_failed_keeps_its_buffer_and_the_next_gets_a_new_one():
    """A buffer is shared by every other probe; a probe given up on may still
    complete (its peer catches up before the group's timeout) and write into it, so the
    probe after a failure must not use it (review)."""
    tensors: list[torch.Tensor] = []
    works: list[object] = [NeverDone(), Done(), Done(), Done()]

    class Group:
        def allreduce(self, tensors_, options):
            tensors.append(tensors_[0])
            return works[len(tensors) - 1]

    sampler = LatencyProbeSampler(group=Group(), timeout_s=0.2)
    try:
        for k in range(4):
            sampler.sample(1.0 + k)
            deadline = time.monotonic() + 5.0
            while sampler._outstanding and time.monotonic() < deadline:
                time.sleep(0.01)
        assert len(tensors) == 4  # probes 1 and 3 share a slot, 2 and 4 the other
        assert tensors[2].data_ptr() != tensors[0].data_ptr()  # after the failure: new
        assert tensors[3].data_ptr() == tensors[1].data_ptr()  # after a success: reused
    finally:
        sampler.close()


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class PendingGroup:
    """A side group whose probes complete when the test says so."""

    def __init__(self) -> None:
        self.works: list[Pending] = []
        self.at: list[float] = []  # wall time of each issue

    def allreduce(self, tensors, options):
        self.works.append(Pending())
        self.at.append(time.time())
        return self.works[-1]


def test_a_tick_skipped_behind_a_late_peer_is_made_up_when_the_probe_completes():
    """A tick that finds the last probe still waiting for a later peer launches none; the
    waiter launches it when that probe completes, so the rank reads again within the
    interval instead of two intervals later (the 100 ms gaps that broke the cadence)."""
    group = PendingGroup()
    sampler = LatencyProbeSampler(group=group, timeout_s=5.0)
    try:
        sampler.sample(1.0)
        sampler.sample(1.05)  # probe 1 still waits for its peer: skipped, owed
        assert len(group.works) == 1
        released = time.time()
        group.works[0].done.set()
        wait_for(lambda: len(group.works) == 2)  # made up without a tick
        assert group.at[1] >= released
        readings = sampler.sample(1.10)  # probe 2 runs: this tick is owed in turn
        assert len(group.works) == 2 and sampler._owed
        group.works[1].done.set()
        wait_for(lambda: len(group.works) == 3)
        group.works[2].done.set()
        wait_for(lambda: sampler._outstanding == 0)
        time.sleep(0.05)
        assert len(group.works) == 3  # one probe per tick, no more
        assert not sampler._owed
        readings += sampler.sample(1.15)  # a tick with nothing running launches as before
        assert len(group.works) == 4 and not sampler._owed
        stamps = [ts for _, _, _, ts in readings]
        assert stamps == sorted(stamps) and stamps[0] == 1.0 and stamps[1] >= released
    finally:
        for work in group.works:
            work.done.set()
        sampler.close()


def test_no_probe_is_made_up_once_shutdown_holds_the_count_or_after_a_failure():
    group = PendingGroup()
    sampler = LatencyProbeSampler(group=group, timeout_s=5.0)
    try:
        sampler.sample(1.0)
        sampler.sample(1.05)  # owed
        with sampler._launch_lock, sampler._lock:
            sampler._hold = True  # what `stop_aligned` does first
        group.works[0].done.set()
        wait_for(lambda: sampler._outstanding == 0)
        time.sleep(0.05)
        assert len(group.works) == 1
    finally:
        for work in group.works:
            work.done.set()
        sampler.close()

    failing = LatencyProbeSampler(group=None, timeout_s=0.2)
    failing._owed = True
    failing._outstanding = 1
    failing._queue.put(probe(1, NeverDone()))
    failing._waiter = threading.Thread(target=failing._wait_loop, daemon=True)
    failing._waiter.start()
    wait_for(lambda: failing._outstanding == 0)
    time.sleep(0.05)
    assert failing.failed and failing._owed  # nothing launched on a group that failed
    failing.close()
