"""The job-side entry for one rank.

Contract: `trainspec.init()` reads torchrun's environment, starts the collector (samplers on
a thread, sinks on another) and the side gloo groups, and returns a `Session`. The session
wraps the model (`session.wrap`, registering the gradient hook), times data
(`session.iter_data`) and steps (`with session.step(samples=...) as s: with s.phase(...)`),
records events, and at `session.close()` flushes everything, every rank in step. The same
wiring is what `trainspec run` injects into an unmodified script (`runtime.auto`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported when first asked for: `trainspec run` and `demo` read `runtime.identity` (a run
# id) and would otherwise import torch (3 s here) through the checkpoint engine. `init` is
# `trainspec.init` (or `trainspec.runtime.init.init`): the name is also the submodule's,
# which a lazy export could not keep apart.
_WHERE = {
    "current": "init",
    "Checkpointer": "checkpoint",
    "CheckpointError": "checkpoint",
    "CorruptCheckpointError": "checkpoint",
    "LoadedCheckpoint": "checkpoint",
    "SaveRecord": "checkpoint",
    "WorldSizeMismatchError": "checkpoint",
    "Heartbeat": "heartbeat",
    "PreemptionWatcher": "heartbeat",
    "FaultPlan": "inject",
    "Injector": "inject",
    "Session": "session",
    "StepContext": "session",
}

if TYPE_CHECKING:
    from trainspec.runtime.checkpoint import (
        Checkpointer,
        CheckpointError,
        CorruptCheckpointError,
        LoadedCheckpoint,
        SaveRecord,
        WorldSizeMismatchError,
    )
    from trainspec.runtime.heartbeat import Heartbeat, PreemptionWatcher
    from trainspec.runtime.init import current
    from trainspec.runtime.inject import FaultPlan, Injector
    from trainspec.runtime.session import Session, StepContext


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'trainspec.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainspec.runtime.{module}"), name)
    # Bound here, over the submodule the import just bound (`init` is both): as eagerly.
    globals()[name] = value
    return value


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "FaultPlan",
    "Heartbeat",
    "Injector",
    "LoadedCheckpoint",
    "PreemptionWatcher",
    "SaveRecord",
    "Session",
    "StepContext",
    "WorldSizeMismatchError",
    "current",
]
