"""Collective latency: a one-element all-reduce on a side gloo group, never the training group.

Each probe is two back-to-back all-reduces: the first lines the ranks up (a rank whose
sampler thread woke late would otherwise be measured as latency), the second is timed.
The k-th probe of every rank meets the k-th of every other, so ranks must stop after the
same number of probes: `stop_aligned` agrees on that number over the control group while
the probe threads keep running, so no rank waits for a probe that will never come.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler

log = logging.getLogger("trainspec.collector")
_NO_ATTRS = attrs_json()


class LatencyProbeSampler(Sampler):
    name = "latency"
    dedicated_thread = True

    def __init__(self, group: Any, *, interval_s: float = 0.05, timeout_s: float = 10.0) -> None:
        import torch

        self.group = group
        self.interval_s = interval_s
        self.timeout = timedelta(seconds=timeout_s)
        self._buf = torch.zeros(1)
        self.count = 0  # probes completed
        self._started = 0  # probes begun; final once `_hold` is set
        self._hold = False
        self._target: int | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    def unavailable_reason(self) -> str | None:
        import torch.distributed as dist

        if self.group is None or not dist.is_initialized():
            return "not a distributed run (one rank): no collective to probe"
        return None

    def _all_reduce(self) -> None:
        import torch.distributed as dist

        work = dist.all_reduce(self._buf, group=self.group, async_op=True)
        work.wait(self.timeout)

    def sample(self, now: float) -> list[Reading]:
        with self._lock:
            if self._hold or (self._target is not None and self._started >= self._target):
                if self._target is not None and self._started >= self._target:
                    self._done.set()
                return []
            self._started += 1
        self._all_reduce()
        t0 = time.perf_counter()
        self._all_reduce()
        elapsed = time.perf_counter() - t0
        self.count += 1
        return [("trainspec.comm.probe.latency", elapsed, _NO_ATTRS)]

    def stop_aligned(self, control_group: Any, *, timeout_s: float = 10.0) -> bool:
        """Agree with every rank on the last probe, and wait until this rank has made it.

        Called by every rank at the same program point (shutdown) while the sampler thread
        still runs. Each rank first stops beginning probes, so its count of probes begun is
        final; the ranks then agree on the highest such count over the control group, and
        the ranks behind make up the difference, releasing any probe left waiting on them.
        Returns False when it could not agree (a rank is gone); close then goes on.
        """
        import torch
        import torch.distributed as dist

        with self._lock:
            self._hold = True
            started = self._started
        try:
            counts = torch.tensor([started], dtype=torch.int64)
            work = dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=control_group, async_op=True)
            work.wait(timedelta(seconds=timeout_s))
        except Exception as exc:  # a lost rank: report and let close proceed
            log.warning("trainspec: latency probe could not align shutdown: %s", exc)
            return False
        with self._lock:
            self._target = int(counts.item())
            self._hold = False
        return self._done.wait(timeout_s)
