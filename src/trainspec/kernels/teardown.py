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
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_registered = False


def collect_at_exit() -> None:
    """Register one `gc.collect()` to run at exit (once per process, however often called)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(gc.collect)
            _registered = True
