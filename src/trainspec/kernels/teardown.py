"""Free unreachable reference cycles at exit, while the interpreter is still whole.

DDP, the reducer that holds the process group, the hook registered on it and the futures of
its last step can end a run as unreachable objects in reference cycles. Left to the garbage
collection that interpreter finalization runs, the process group is destroyed then, its
gloo threads still able to reach into Python objects, and a rank was seen to abort with
SIGABRT ("terminate called without an active exception") after its run had finished, in
about 1 of 25-70 runs of bench/compression.py (faulthandler showed the main thread with no
Python frame: interpreter exit). A collection from an `atexit` handler frees those cycles
before finalization starts; torch proposed registering `destroy_process_group` the same
way (pytorch/pytorch#179291) for groups left undestroyed.

A process group a DDP model with a Python communication hook uses is also kept alive until
then (`keep_until_exit`). Each collective the hook launches holds a Python object in its
thread-local state, which the gloo thread that finishes the work releases, taking the
interpreter lock. A script that ends `dist.barrier(); dist.destroy_process_group()` and
returns from `main()` frees its DDP model at once: the reducer held the last reference to
the group, and the group's destructor joined its gloo threads while holding the lock, as
one of them was releasing the barrier's earlier works and waited for it. The rank hung
forever after training, in 1 of about 7 runs with this hook and 2 of 25 with torch's own
`allreduce_hook` (none without a Python hook). Destroyed at exit, the group has no work left.
"""

from __future__ import annotations

import atexit
import gc
import threading
from typing import Any

_lock = threading.Lock()
_registered = False
_kept: list[Any] = []  # process groups released at exit, after the collection


def collect_at_exit() -> None:
    """Register one `gc.collect()` to run at exit (once per process, however often called)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def keep_until_exit(group: Any) -> None:
    """Hold a reference to `group` until exit, so it is not destroyed while a gloo thread
    still finishes one of its works (see above). Once per group."""
    with _lock:
        if all(kept is not group for kept in _kept):
            _kept.append(group)
    collect_at_exit()


def _at_exit() -> None:
    gc.collect()
    with _lock:
        groups = list(_kept)
        _kept.clear()
    del groups  # the groups' destructors run here, every work of theirs long finished
