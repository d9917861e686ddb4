"""Failure detection: a heartbeat between ranks, and an agreed stop on a preemption signal.

`Heartbeat` runs on its own gloo group (never the training group, so it cannot reorder or
stall the job's collectives) on a named daemon thread. Every `interval_s` all ranks meet in
gloo's `monitored_barrier`, which names the ranks that did not arrive within the timeout (a
dead or wedged process), then all-gather their step counters so rank 0 can name a rank that
is alive but makes no progress (a hang in a kernel or a data loader). torchrun restarts a job
whose process died, but not one that hangs; with `exit_on_fault` the detecting rank exits so
torchrun's restart takes over. Faults go to `on_event("fault", cause, evidence)`.

`PreemptionWatcher` turns SIGTERM (what schedulers and torchrun send before killing) into a
flag that all ranks agree on at a step boundary, so every rank saves the same step and exits.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
EventCallback = Callable[[str, str, dict], None]
FAULT_EXIT_CODE = 43
_RANKS_RE = re.compile(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier")


class Heartbeat:
    """Liveness and progress of every rank; create on all ranks alike, then `start()`."""

    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 10.0,
        stall_timeout_s: float = 120.0,
        on_event: EventCallback | None = None,
        exit_on_fault: bool = False,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or stall_timeout_s <= 0:
            raise ValueError("heartbeat interval_s, timeout_s and stall_timeout_s must be positive")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.on_event = on_event
        self.exit_on_fault = exit_on_fault
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainspec-heartbeat", daemon=True)
        self._last_progress = [time.monotonic()] * self.world_size
        self._last_steps = [-1] * self.world_size
        self._stalled: set[int] = set()
        self.faults: list[tuple[int, str]] = []
        self.beats = 0

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """Call from the training loop at each step boundary."""
        self._step = step

    def stop(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                dist.monitored_barrier(
                    group=self._pg, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True
                )
                steps = torch.zeros(self.world_size, dtype=torch.int64)
                mine = torch.tensor([self._step], dtype=torch.int64)
                dist.all_gather(list(steps.chunk(self.world_size)), mine, group=self._pg)
            except Exception as exc:  # the group is broken from here on: report and stop beating
                if not self._stop.is_set():
                    for rank in self._missing_ranks(str(exc)):
                        self._fault(rank, "no heartbeat", {"error": str(exc)[:500]})
                return
            self.beats += 1
            if self.rank == 0:
                self._check_progress(steps.tolist())

    def _missing_ranks(self, message: str) -> list[int]:
        match = _RANKS_RE.search(message)
        if match:  # monitored_barrier timed out and named who did not arrive
            return [int(r) for r in re.findall(r"\d+", match.group(1))]
        # A peer's socket closed before the barrier could name it (the process died). With two
        # ranks the culprit is the other one; beyond that gloo's error does not say (rank -1).
        if self.world_size == 2:
            return [1 - self.rank]
        return [0] if self.rank != 0 else [-1]

    def _check_progress(self, steps: list[int]) -> None:
        now = time.monotonic()
        for rank, step in enumerate(steps):
            if step != self._last_steps[rank]:
                self._last_steps[rank], self._last_progress[rank] = step, now
                self._stalled.discard(rank)
            elif (
                now - self._last_progress[rank] > self.stall_timeout_s and rank not in self._stalled
            ):
                self._stalled.add(rank)
                idle = now - self._last_progress[rank]
                self._fault(rank, "no progress", {"step": step, "idle_s": round(idle, 3)})

    def _fault(self, rank: int, cause: str, evidence: dict) -> None:
        self.faults.append((rank, cause))
        log.warning("fault detected on rank %d: %s %s", rank, cause, evidence)
        if self.on_event is not None:
            try:
                self.on_event("fault", cause, {"rank": rank, "detected_by": self.rank, **evidence})
            except Exception:
                log.exception("fault event callback failed")
        if self.exit_on_fault:
            os._exit(FAULT_EXIT_CODE)


class PreemptionWatcher:
    """SIGTERM sets a flag; `should_stop()` tells every rank alike whether any rank got one."""

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        grace_s: float = 20.0,
        signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        # Alone (one process, no process group) the flag is its own answer.
        solo = not (dist.is_available() and dist.is_initialized())
        self._pg = None if solo else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s)
        )  # fmt: skip
        self.grace_s = grace_s
        self.requested_at: float | None = None
        self.signal_received: int | None = None
        self._deadline: threading.Timer | None = None
        self._closed = False
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.requested_at is not None:
            os._exit(128 + signum)  # asked twice: stop now
        self.requested_at = time.monotonic()
        self.signal_received = signum
        # A process whose loop is dead or wedged never reaches the next step boundary: without
        # this deadline it would ignore SIGTERM and hold up torchrun's restart until SIGKILL.
        self._deadline = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        self._deadline.daemon = True
        self._deadline.start()

    def should_stop(self) -> bool:
        """All ranks call at the same step boundary; True on all if any rank was signalled."""
        if self._pg is None:
            return self.requested_at is not None
        flag = torch.tensor([0 if self.requested_at is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        return bool(flag.item())

    def disarm(self) -> None:
        """Cancel the exit deadline: the loop reached a boundary and is stopping on its own."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline.join(timeout=1.0)
            self._deadline = None

    def close(self) -> None:
        """Disarm the exit deadline and give the signals back to their previous handlers.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.disarm()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
