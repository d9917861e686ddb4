"""Run the collector's background threads at a lower CPU priority than the training threads.

On a machine whose cores the training threads keep busy (CPU training, or a host thread per
GPU feeding kernels), every tick of a sampler or a flush competes with a rank for a core.
Linux schedules threads individually and `setpriority(PRIO_PROCESS, tid, n)` sets one
thread's nice value, so the collector's threads can yield to training: the CFS scheduler
weighs a thread at nice 10 about a tenth of one at nice 0, so they run mostly in the gaps
where a rank waits (its all-reduce, its data). They still get every cycle they need on an
idle core, so sampling keeps its interval wherever the machine is not saturated.

Raising one's own nice value needs no privilege; where it is not possible (not Linux, a
sandbox without the syscall) the thread keeps its priority and says so once in debug logs.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("trainspec.collector")


def lower_current_thread(nice: int) -> bool:
    """Add `nice` to the calling thread's nice value; True when it took effect."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        log.debug("trainspec: thread %s keeps its priority: %s", tid, exc)
        return False
    return True
