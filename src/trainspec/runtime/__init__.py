"""The job-side entry for one rank.

Contract: `trainspec.init()` reads torchrun's environment, starts the collector (samplers on
a thread, sinks on another) and the side gloo groups, and returns a `Session`. The session
wraps the model (`session.wrap`, registering the gradient hook), times data
(`session.iter_data`) and steps (`with session.step(samples=...) as s: with s.phase(...)`),
records events, and at `session.close()` flushes everything, every rank in step. The same
wiring is what `trainspec run` injects into an unmodified script (`runtime.auto`).
"""

from __future__ import annotations

from trainspec.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    LoadedCheckpoint,
    SaveRecord,
    WorldSizeMismatchError,
)
from trainspec.runtime.heartbeat import Heartbeat, PreemptionWatcher
from trainspec.runtime.init import current, init
from trainspec.runtime.inject import FaultPlan, Injector
from trainspec.runtime.session import Session, StepContext

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
    "init",
]
