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


def test_registering_the_hook_keeps_its_group_until_the_exit_handler(monkeypatch):
    import torch.distributed as dist

    from trainspec.kernels import CompressionHook, teardown

    calls = []
    monkeypatch.setattr(teardown, "_registered", False)
    monkeypatch.setattr(teardown, "_kept", [])
    monkeypatch.setattr(teardown.atexit, "register", lambda fn: calls.append(fn))

    class Model:
        process_group = object()

        def register_comm_hook(self, state, hook):
            self.state = state

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    model = Model()
    CompressionHook("none").register(model)
    CompressionHook("none").register(model)  # a group is kept once
    assert len(calls) == 1 and calls[0].__name__ == "_at_exit"
    assert teardown._kept == [Model.process_group]


KEPT = """
import sys
from trainspec.kernels import teardown

class Group:
    def __del__(self):
        print("finalizing" if sys.is_finalizing() else "before", flush=True)

teardown.keep_until_exit(Group())
print("kept", flush=True)
"""


def test_a_kept_group_is_released_at_exit_before_finalization():
    # Released by the model's destructor, a group's gloo threads could be finishing a work
    # that needs the interpreter lock the destructor holds (teardown.py): a hang after training.
    out = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kept", "before"]
