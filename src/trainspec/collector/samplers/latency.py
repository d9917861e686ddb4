"""Collective latency: a small all-reduce on a side gloo group, never the training group.

Each probe is one asynchronous all-reduce, timed on every rank from its launch to its
completion by a waiter thread that reads the probes in order. A rank whose sampler thread
woke late would see only latency while the others also waited for it, so the reading is the
smallest duration over the ranks: the last rank to arrive measured the collective alone.
That minimum costs no second collective: each probe's payload is this rank's duration of the
probe before it (`probe_ledger.py`), and the reading for a probe comes out of the next one.

A rank has at most `LAGS` (1) probes in flight: a tick that finds that many still running
launches none, and a probe's payload holds one slot per probe that may still be running at
its launch, so every reading comes out of one of the next `LAGS` probes. Between two gloo
ranks an all-reduce of 1 element made 3 socket writes per call, of 2 elements 6, of 4 or
more 12 (strace, 200 calls each); until 2026-11-25 the payload had 40 slots. Ranks' ticks
fall at unrelated phases, so a probe waits up to an interval for a peer's launch, and on a
loaded host the next tick often finds it still running: in four two-rank demos on the 2-core
VM under load 5-10, 8-25 of a rank's 457-823 gaps were such 100 ms skips, and two of the
four failed the probe's cadence (p95 gap 0.100 s > 0.075 s). Since 2026-11-27 the waiter
launches a skipped tick's probe as soon as the probe it waited behind completes
(`_make_up`): at most one launch per tick still, and no 100 ms gap unless the peer is late
by more than an interval (a rank 1 late by 60 ms every fourth tick left rank 0 31 readings
of 40 and nine 100 ms gaps before; 40 and none above 66 ms after). `LAGS = 2` had removed
most skips too (alternated demos beside two busy loops: 3-6 against 4-13 per run) but was
reverted the same day over a latency-spike advice in a healthy CI job (docs/collector.md).

The sampling loop only launches probes and collects finished ones (the waiter launches
only make-ups), so it never waits on a peer: a probe's reading is stamped with its launch time, and the 50 ms cadence holds even
when a peer is slow. Timing is read from Python, so on CPU-bound ranks it includes the wait
for the interpreter lock.

The k-th probe of every rank meets the k-th of every other, so ranks must stop after the
same number of probes: `stop_aligned` agrees on that number over the control group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.probe_ledger import UNKNOWN, ProbeLedger

log = logging.getLogger("trainspec.collector")
_NO_ATTRS = attrs_json()
METRIC = "trainspec.comm.probe.latency"
LAGS = 1  # the payload: this rank's durations of the LAGS probes before (LAGS in flight at most)
# Two were tried on 2026-11-27: fewer 100 ms skips under load (below), but a healthy CI run
# then raised a latency-spike advice (window median 3.6 ms against a 0.68 ms baseline for
# three windows) that one in flight had not; back to one until that is measured.
WAIT_SLICE_S = 0.25  # the longest the waiter stays inside one native wait (`_wait`)


@dataclass
class _Probe:
    index: int  # 1-based, the same probe on every rank
    launched_at: float  # wall time, the reading's stamp
    started: float  # perf_counter at launch
    work: Any  # the all-reduce, or None: `close` woke the waiter
    payload: Any  # what it reduces in place, as doubles (a view of the tensor's memory)


class _Closing(Exception):
    """The sampler is closing (or, for `stop_aligned`, a probe failed): the wait is
    abandoned."""


class LatencyProbeSampler(Sampler):
    name = "latency"
    times_peers = True

    def __init__(self, group: Any, *, interval_s: float = 0.05, timeout_s: float = 10.0) -> None:
        self.group = group
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        # Held from a probe's numbering to its queueing, by whichever thread launches (the
        # sampler's, or the one in `stop_aligned`): numbering order = issue order = the
        # order gloo pairs probes across ranks = the waiter's order.
        self._launch_lock = threading.Lock()
        self._launched = 0  # probes issued; final once `_hold` is set
        self._hold = False
        # A tick found LAGS probes still running and launched none: the waiter launches that
        # probe as soon as one completes (`_make_up`), not a whole interval later.
        self._owed = False
        self._finished: list[tuple[float, float]] = []  # (launch wall time, seconds)
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Probe] = queue.SimpleQueue()
        self._ledger = ProbeLedger(lags=LAGS)
        # Per probe index mod LAGS: (the payload's memory as doubles, a tensor over it);
        # None: make a new one.
        self._buffers: list[tuple[Any, Any] | None] = [None] * LAGS
        self._options: Any = None
        self._waiter: threading.Thread | None = None
        self._closing = threading.Event()
        self.count = 0  # probes completed
        self.failed = False  # a probe timed out or failed: the group may never line up again

    def unavailable_reason(self) -> str | None:
        import torch.distributed as dist

        if self.group is None or not dist.is_initialized():
            return "not a distributed run (one rank): no collective to probe"
        return None

    def _launch(self, now: float) -> None:
        """Issue the next probe; the caller holds `_launch_lock`. Counted only once issued,
        so a launch that raises leaves the numbering as it was."""
        import torch
        import torch.distributed as dist

        with self._lock:
            index = self._launched + 1
            values = self._ledger.launched(index, now)
        slot = index % LAGS
        buffer = self._buffers[slot]
        if buffer is None:
            # One buffer per slot, reused by every LAGS-th probe (probe k + LAGS is launched
            # only once the waiter has read probe k; a probe abandoned as failed keeps its
            # own), written through a memoryview: a fresh torch.tensor cost 113-173 us of
            # CPU at a 50 ms cadence (cold caches), a write through the view 14-18 us.
            memory = bytearray(8 * LAGS)
            buffer = (memoryview(memory).cast("d"), torch.frombuffer(memory, dtype=torch.float64))
            self._buffers[slot] = buffer
        if self._options is None:
            self._options = dist.AllreduceOptions()
            self._options.reduceOp = dist.ReduceOp.MAX
        view, payload = buffer
        for lag, value in enumerate(values):
            view[lag] = value
        started = time.perf_counter()
        # The group's own allreduce: dist.all_reduce's Python checks around the same call
        # cost 165 us a launch against 109 us at that cadence.
        work = self.group.allreduce([payload], self._options)
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=self._wait_loop, name="trainspec-probe-wait", daemon=True
            )
            self._waiter.start()
        with self._lock:
            self._launched = index
            self._outstanding += 1
        self._queue.put(_Probe(index, now, started, work, view))

    def _wait_loop(self) -> None:
        """Wait on each probe in launch order and hand its duration and the group's payload
        to the ledger, which gives back the readings every rank has now finished."""
        while not self._closing.is_set():
            probe = self._queue.get()
            if probe.work is None:  # `close` woke us
                return
            seconds = None
            try:
                self._wait(probe.work, time.monotonic() + self.timeout_s)
                seconds = time.perf_counter() - probe.started
            except _Closing:
                return
            except Exception as exc:  # a timed-out or broken probe yields no reading
                log.debug("trainspec: latency probe failed: %s", exc)
            result = probe.payload.tolist() if seconds is not None else [UNKNOWN] * LAGS
            with self._lock:
                if seconds is None:
                    # Its all-reduce may still complete (a peer that catches up before the
                    # group's timeout) and write its buffer: the next probe of its slot gets
                    # a new one.
                    self._buffers[probe.index % LAGS] = None
                self._outstanding -= 1
                # A later probe completing means every rank launched it: the group lives,
                # and a failure before it was transient.
                self.failed = seconds is None
                if seconds is not None:
                    self.count += 1
                self._finished.extend(self._ledger.finished(probe.index, seconds, result))
                self._idle.notify_all()
            if seconds is not None:
                self._make_up()

    def _make_up(self) -> None:
        """Launch the probe a tick skipped, now that one is done. A rank whose tick fell
        while its last probe waited for a later peer otherwise reads nothing for two
        intervals: a 100 ms gap at 50 ms, which on a loaded host broke the probe's cadence
        (p95 gap 0.089 s > 0.075 s in a CI run). It costs no extra probes: one launch per
        skipped tick, at most. The peer that arrived late has launched this probe's partner
        already or does so at its next tick, and the reading (the smallest duration over the
        ranks) is that peer's, so the make-up's own wait is not read as latency."""
        if not self._owed:  # the usual case, read without the locks (checked again under them)
            return
        with self._launch_lock:
            with self._lock:
                launch = (
                    self._owed
                    and not self._hold
                    and not self._closing.is_set()
                    and self._outstanding < LAGS
                )
                if launch:
                    self._owed = False
            if launch:
                try:
                    self._launch(time.time())
                except Exception as exc:  # the next tick tries again
                    log.debug("trainspec: latency probe make-up launch failed: %s", exc)

    def _wait(self, work: Any, deadline: float, *, give_up_on_failure: bool = False) -> None:
        """`work.wait()` in slices of at most WAIT_SLICE_S, so this thread is never inside
        torch's native wait for long: a daemon thread that returns from one (re-taking the
        interpreter lock) after interpreter shutdown has begun is ended inside C++ and
        aborts the process ("terminate called without an active exception"), which a peer
        that hung at exit made happen. Raises TimeoutError past `deadline`, `_Closing` once
        `close` was called (or, with `give_up_on_failure`, once a probe failed), and the
        collective's own error if it failed."""
        while True:
            if self._closing.is_set() or (give_up_on_failure and self.failed):
                raise _Closing
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"latency probe not complete after {self.timeout_s:g} s")
            try:
                # At least 1 ms: torch reads a timeout that rounds to 0 ms as 'no timeout'.
                work.wait(timedelta(milliseconds=max(1.0, 1000.0 * min(WAIT_SLICE_S, left))))
                return
            except Exception:
                if not work.is_completed():
                    continue  # only this slice ran out
            # It completed, perhaps just after the slice ran out: this returns on success
            # and raises the collective's own error on failure.
            work.wait(timedelta(milliseconds=1))
            return

    def close(self) -> None:
        """Stop the waiter (within about WAIT_SLICE_S) before the interpreter shuts down;
        probes still in flight are abandoned."""
        self._closing.set()
        self._queue.put(_Probe(0, 0.0, 0.0, None, None))
        waiter = self._waiter
        if waiter is not None:
            waiter.join(4 * WAIT_SLICE_S)

    def sample(self, now: float) -> list[Reading]:
        with self._launch_lock:
            with self._lock:
                finished, self._finished = self._finished, []
                # At most LAGS at a time: probes still running (a slow peer) hold back more.
                launch = not self._hold and self._outstanding < LAGS
                self._owed = not self._hold and not launch
                self._idle.notify_all()  # `stop_aligned` waits for its last readings to go
            if launch:
                self._launch(now)
        # Stamped with the launch time: the moment the latency was measured for.
        return [(METRIC, value, _NO_ATTRS, ts) for ts, value in sorted(finished)]

    def stop_aligned(self, control_group: Any, *, timeout_s: float = 10.0) -> bool:
        """Agree with every rank on the last probe, make it, and wait for all to complete.

        Called by every rank at the same program point (shutdown) while the sampler thread
        still runs. Each rank first stops launching, so its count of probes launched is
        final; the ranks agree on the highest count over the control group, those behind
        launch the difference, and each waits until its probes have completed. One more
        probe then carries every rank's durations of them, so they are read out too, and
        the sampler thread's next tick takes those readings. Returns False when it could not
        agree or finish in time (a rank is gone).
        """
        import torch
        import torch.distributed as dist

        with self._launch_lock, self._lock:
            self._hold = True
            launched = self._launched
        deadline = time.monotonic() + timeout_s
        try:
            # A failed probe means a peer stopped answering: nothing would line up, so the
            # agreement is not waited for (also when the probe fails during it, as when the
            # training group's timeout and the probe's expire together).
            if self.failed or self._closing.is_set():
                raise _Closing
            counts = torch.tensor([launched], dtype=torch.int64)
            work = dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=control_group, async_op=True)
            self._wait(work, deadline, give_up_on_failure=True)
        except _Closing:
            log.warning("trainspec: latency probes failed; shutdown not aligned")
            return False
        except Exception as exc:  # a lost rank: report and let close proceed
            log.warning("trainspec: latency probe could not align shutdown: %s", exc)
            return False
        target = int(counts.item())
        try:
            if not self._drained(deadline):
                return False
            for _ in range(target - launched):  # one at a time, as the sampler launches
                with self._launch_lock:
                    self._launch(time.time())
                if not self._drained(deadline):
                    return False
            with self._launch_lock:  # the carrier: every rank has finished every probe
                self._launch(time.time())
        except Exception as exc:
            log.warning("trainspec: latency probe could not align shutdown: %s", exc)
            return False
        if not self._drained(deadline):
            return False
        # Leave the readings to the sampler thread's next tick (if it still runs).
        with self._lock:
            until = min(deadline, time.monotonic() + 4 * self.interval_s)
            while self._finished and time.monotonic() < until:
                self._idle.wait(until - time.monotonic())
        return True

    def _drained(self, deadline: float) -> bool:
        """Wait until every probe launched has completed; False on a failure, close, or past
        `deadline`."""
        with self._lock:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self.failed or self._closing.is_set():
                    return False
                self._idle.wait(min(left, WAIT_SLICE_S))
        return True
