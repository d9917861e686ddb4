"""Collective latency: a one-element all-reduce on a side gloo group, never the training group.

Each probe is two back-to-back asynchronous all-reduces. The first lines the ranks up (a
rank whose sampler thread woke late would otherwise be measured as latency); the second is
timed from the first's completion to its own, by a waiter thread that reads both in order.
The sampling loop only launches probes and collects finished ones, so it never waits on a
peer: a probe's reading is stamped with its launch time, and the 50 ms cadence holds even
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
from datetime import timedelta
from typing import Any

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler

log = logging.getLogger("trainspec.collector")
_NO_ATTRS = attrs_json()
METRIC = "trainspec.comm.probe.latency"
MAX_IN_FLIGHT = 40  # 2 s of probes: beyond this a peer is gone, not slow
WAIT_SLICE_S = 0.25  # the longest the waiter stays inside one native wait (`_wait`)


class _Closing(Exception):
    """The sampler is closing (or, for `stop_aligned`, a probe failed): the wait is
    abandoned."""


class LatencyProbeSampler(Sampler):
    name = "latency"
    dedicated_thread = True

    def __init__(self, group: Any, *, interval_s: float = 0.05, timeout_s: float = 10.0) -> None:
        self.group = group
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._started = 0  # probes launched; final once `_hold` is set
        self._hold = False
        self._finished: list[tuple[float, float]] = []  # (launch wall time, seconds)
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[tuple[float, Any, Any]] = queue.SimpleQueue()
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
        import torch
        import torch.distributed as dist

        first = dist.all_reduce(torch.zeros(1), group=self.group, async_op=True)
        second = dist.all_reduce(torch.zeros(1), group=self.group, async_op=True)
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=self._wait_loop, name="trainspec-probe-wait", daemon=True
            )
            self._waiter.start()
        self._queue.put((now, first, second))

    def _wait_loop(self) -> None:
        """Wait on each probe's two all-reduces in launch order: the second's round trip is
        the time between the two completions (both read on this one thread, so in order)."""
        while not self._closing.is_set():
            launched_at, first, second = self._queue.get()
            if first is None:  # `close` woke us
                return
            value = None
            try:
                deadline = time.monotonic() + self.timeout_s
                self._wait(first, deadline)
                t1 = time.perf_counter()
                self._wait(second, deadline + self.timeout_s)
                value = time.perf_counter() - t1
            except _Closing:
                return
            except Exception as exc:  # a timed-out or broken probe yields no reading
                log.debug("trainspec: latency probe failed: %s", exc)
            with self._lock:
                self._outstanding -= 1
                # A later probe completing means every rank launched it: the group lives,
                # and a failure before it was transient.
                self.failed = value is None
                if value is not None:
                    self._finished.append((launched_at, value))
                    self.count += 1
                self._idle.notify_all()

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
        self._queue.put((0.0, None, None))
        waiter = self._waiter
        if waiter is not None:
            waiter.join(4 * WAIT_SLICE_S)

    def sample(self, now: float) -> list[Reading]:
        with self._lock:
            finished, self._finished = self._finished, []
            launch = not self._hold and self._outstanding < MAX_IN_FLIGHT
            if launch:
                self._started += 1
                self._outstanding += 1
        if launch:
            try:
                self._launch(now)
            except Exception:
                with self._lock:
                    self._outstanding -= 1
                raise
        # Stamped with the launch time: the moment the latency was measured for.
        return [(METRIC, value, _NO_ATTRS, ts) for ts, value in sorted(finished)]

    def stop_aligned(self, control_group: Any, *, timeout_s: float = 10.0) -> bool:
        """Agree with every rank on the last probe, make it, and wait for all to complete.

        Called by every rank at the same program point (shutdown) while the sampler thread
        still runs. Each rank first stops launching, so its count of probes launched is
        final; the ranks agree on the highest count over the control group, those behind
        launch the difference, and each waits until its probes have completed. Returns
        False when it could not agree or finish in time (a rank is gone).
        """
        import torch
        import torch.distributed as dist

        with self._lock:
            self._hold = True
            started = self._started
        try:
            # A failed probe means a peer stopped answering: nothing would line up, so the
            # agreement is not waited for (also when the probe fails during it, as when the
            # training group's timeout and the probe's expire together).
            if self.failed or self._closing.is_set():
                raise _Closing
            counts = torch.tensor([started], dtype=torch.int64)
            work = dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=control_group, async_op=True)
            self._wait(work, time.monotonic() + timeout_s, give_up_on_failure=True)
        except _Closing:
            log.warning("trainspec: latency probes failed; shutdown not aligned")
            return False
        except Exception as exc:  # a lost rank: report and let close proceed
            log.warning("trainspec: latency probe could not align shutdown: %s", exc)
            return False
        target = int(counts.item())
        now = time.time()
        with self._lock:
            missing = target - self._started
            self._started = target
            self._outstanding += missing
        try:
            for _ in range(missing):
                self._launch(now)
        except Exception as exc:
            log.warning("trainspec: latency probe could not align shutdown: %s", exc)
            return False
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self.failed or self._closing.is_set():
                    return False
                self._idle.wait(min(left, WAIT_SLICE_S))
        return True
