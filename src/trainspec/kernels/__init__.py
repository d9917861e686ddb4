"""Gradient compression for DDP, and the gradient statistics that ride along.

Contract:
- `parse_level(text)` accepts `none`, `bf16`, `int8[:BLOCK]` (block-scaled, error
  feedback), `lowrank:R[:W[:WARM]]` (PowerSGD, error feedback, warm start; the first W
  steps int8, or exact float32 sums with WARM `exact`), `lowrank-bf16:R[:W[:WARM]]` (the
  same with P and Q sent in bfloat16: rank 2R for the bytes of rank R), `topk:F` (each
  bucket's largest fraction F of values by magnitude, error feedback; summed by an
  all-gather of value and index pairs) and raises
  `LevelError` (a ValueError, one line) otherwise; `make_codec` builds the `Codec` for a
  level.
- `CompressionHook(level, group=..., local_batch_size=..., seed=...)` is one DDP
  communication hook (`seed`: the lowrank levels' starting Q, the same on every rank);
  `hook.register(ddp)` installs it; a hook made without a group sums over DDP's group, a
  sub-group's when DDP has one (pipeline plus data parallelism). `set_level(level, at_step)` and `set_shares(n_r, N)`
  take effect at a step boundary and must be called identically on every rank. With
  shares set, the reduced gradient is sum_r (n_r / N) g_r, the full-batch gradient.
  Between steps, `hook.next_level` and `hook.error_feedback()` (this rank's residuals, one
  piece per parameter) are what a checkpoint saves; `restore_error_feedback` puts them back.
  A step whose gradient holds a NaN or an infinity on any rank sums to a non-finite result
  at every level (a GradScaler skips it) and leaves error feedback as it was before it.
  Known limit: with `find_unused_parameters`, a parameter that no rank uses in a step (a
  branch taken on some steps only) has that step's reduced values discarded by DDP, and the
  error feedback the hook sent for it is lost with them (QA 2026-11-27: 5e-3 to 1.5e-2 of
  the owed sum at int8, up to 0.23 at topk:0.1; parameters used every step, or never, keep
  it to 1e-7). DDP's map of used parameters is known only once its backward has finished.
- `hook.latest_stats()` returns the last step's frozen `GradientStats` (grad norm, variance
  across ranks, EMA gradient noise scale, bytes this rank sent, all-reduce seconds) or None.
  Costs four floats on the last bucket's all-reduce (`none`) or one 4-float all-reduce per
  step. |G|^2 is the squared norm of the sum each level really applied: exact at `none`,
  within the codec's error at `bf16` and `int8`, but at `lowrank` and `topk` a part of the
  gradient, so the variance and noise scale there come out too high (a QA run: 4538 at
  `lowrank:2` against 12.4 at `none` on a small MLP). No exact |G|^2 is had without an
  exact sum; read them at those levels as an upper bound. On CUDA the totals reach the host without a device synchronization
  (`late_stats.py`): `hook.step_summary()` may hand out a `LateStats` that computes them
  when read, and `latest_stats()` waits for them if they are still in flight.
  `MicroStepStats` gives the same statistics across gradient-accumulation micro-steps in one
  process (`take_step` / `stats_of` to read them late).
- Byte counts follow the ring model documented in `wire.py`; every collective's payload is
  recorded in `hook.last_step_records`.
- Torch reference codecs run on CPU and CUDA; Triton kernels for int8 (`triton_int8.py`)
  and for the passes around topk's selection (`triton_topk.py`) are used for CUDA tensors
  when Triton imports. Nothing here imports a collector: readers
  pull statistics, the hook pushes nothing.
"""

from __future__ import annotations

from trainspec.kernels.codecs import (
    Codec,
    CodecResult,
    Level,
    LevelError,
    make_codec,
    parse_level,
)
from trainspec.kernels.hook import CompressionHook, compression_hook
from trainspec.kernels.microstep import MicroStepStats
from trainspec.kernels.stats import GradientStats
from trainspec.kernels.wire import LocalWire, Wire, WireRecord

__all__ = [
    "Codec",
    "CodecResult",
    "CompressionHook",
    "GradientStats",
    "Level",
    "LevelError",
    "LocalWire",
    "MicroStepStats",
    "Wire",
    "WireRecord",
    "compression_hook",
    "make_codec",
    "parse_level",
]
