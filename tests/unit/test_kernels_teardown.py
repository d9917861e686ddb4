"""Reference cycles left by a run are freed before interpreter exit, not during it."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import gc, sys
from trainspec.kernels import teardown

class Probe:
    def __del__(self):
        print("finalizing" if sys.is_finalizing() else "before", flush=True)

gc.disable()  # only an explicit collection frees the cycle, as between automatic ones
probe = Probe()
probe.cycle = probe
del probe
if sys.argv[1] == "register":
    teardown.collect_at_exit()
    teardown.collect_at_exit()  # registered once however often called
"""


@pytest.mark.parametrize(("mode", "expected"), [("register", "before"), ("none", "finalizing")])
def test_a_cycle_left_at_exit_is_freed_before_finalization_only_with_the_handler(mode, expected):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() in ([expected], [] if expected == "finalizing" else [expected])


def test_registering_the_hook_registers_the_collection(monkeypatch):
    import torch.distributed as dist

    from trainspec.kernels import CompressionHook, teardown

    calls = []
    monkeypatch.setattr(teardown, "_registered", False)
    monkeypatch.setattr(teardown.atexit, "register", lambda fn: calls.append(fn))

    class Model:
        def register_comm_hook(self, state, hook):
            self.state = state

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    CompressionHook("none").register(Model())
    assert len(calls) == 1 and calls[0].__name__ == "collect"
