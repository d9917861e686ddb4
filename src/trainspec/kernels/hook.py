"""`CompressionHook`: one DDP communication hook for every compression level.

Register with ``hook.register(ddp_model)`` (which calls
``ddp_model.register_comm_hook(hook, compression_hook)``). Per step it:

- weights this rank's bucket by n_r / N (`set_shares`; default 1 / W) and sums over ranks,
  so the result is the full-batch gradient (n_r * W / N times the gradient, then averaged);
- adds the bucket's error-feedback residual, hands it to the level's codec, keeps the new
  residual;
- serialises buckets on one future chain: bucket k's collectives are launched from the
  continuation that finishes bucket k-1. Codecs with two rounds (PowerSGD) launch the
  second from a continuation, and without this chain two ranks could enqueue collectives
  in different orders and mismatch. Levels whose codec launches all its collectives inside
  `reduce` (`none`, `bf16`) skip the chain and launch each bucket as DDP hands it over:
  DDP does so in bucket order on every rank, so the order still matches. No callback ever
  blocks on a wait;
- sums [|g_r|^2, 1/n_r, n_r, flags] over ranks and publishes `GradientStats` (see stats.py),
  read with `latest_stats()`. At `none` (float32) the four values ride at the end of the last
  bucket's own all-reduce, so the statistics add no collective; at the other levels they go
  in a 4-float all-reduce of their own (for `bf16` launched beside the last bucket's, for
  the chained levels after it). A second collective in flight beside the last bucket's made
  one step in about 150 wait some 40 ms for its gradients on this project's 2-core machine
  (docs/collector.md); carried, the statistics cost 16 bytes and no round of their own;
- under DDP's `join()` (uneven inputs) counts only the ranks that trained the step: a rank's
  shadow pass (its data ran out) adds exactly 0 to every bucket's sum at every level
  (`Codec.reduce_shadow`), keeps its error feedback as it was for its later steps, and sends
  a share of 0 and nothing to the statistics' sums; where DDP averages over the ranks left
  (`divide_by_initial_world_size=False`) every bucket's sum is scaled to the mean over the
  samples trained (`_scaled`).

Level switches (`set_level`) and shares (`set_shares`) take effect at a step boundary; every
rank must make the same calls with the same arguments (the actuator guarantees that), so
every rank switches, keeps or resets error feedback at the same step. For a checkpoint, the
error feedback is read out (`error_feedback`) and put back (`restore_error_feedback`) one
piece per parameter rather than per bucket: a restarted job's DDP starts from its initial
buckets, not the rebuilt ones the residuals were kept for. At DDP's rebuild (after the first
step of any job, a resumed one too) every residual follows its parameters into the rebuilt
buckets (residual_layout.py); none is dropped.
Errors inside a collective or codec are set on the bucket's future, so DDP raises them from
`backward()` rather than hanging (or applying this rank's unreduced gradient). That includes
the statistics' all-reduce: it is a collective every rank is in, and its failure means the
group is broken, so the step's last bucket fails with it. A failure computing statistics
from values that did arrive only loses the statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainspec.kernels.codecs import (
    Codec,
    CodecResult,
    Level,
    make_codec,
    parse_level,
    resolve_level,
)
from trainspec.kernels.codecs.base import CarryingCodec
from trainspec.kernels.codecs.lowrank import MAX_SEED
from trainspec.kernels.hook_futures import _launch_now, _same, _stream_mark, _wait_for
from trainspec.kernels.hook_group import needs_own_group, own_group
from trainspec.kernels.hook_join import JoinHandling, _open_gates, _Scaling
from trainspec.kernels.hook_stats import StepStatistics, _past_float32
from trainspec.kernels.late_stats import LateStats, Unpublished
from trainspec.kernels.residual_layout import (
    Layout,
    bucket_shapes,
    fit_residual,
    layout_of,
    split_by_parameter,
    take_residual,
)
from trainspec.kernels.stats import (
    GradientStats,
    NoiseScaleEMA,
    squared_norm,
)
from trainspec.kernels.teardown import keep_until_exit
from trainspec.kernels.wire import (
    Wire,
    WireRecord,
    chain,
    completed,
    follow,
    for_ddp,
    future_devices,
)


def configured_level(config: Any) -> Level:
    """The level a `KernelsConfig`-like object asks for: `int8:B` names its block; plain
    `int8` takes `int8_block_size`. Raises LevelError naming a bad level."""
    return resolve_level(str(config.compression), getattr(config, "int8_block_size", None))


@dataclass(frozen=True)
class _PendingLevel:
    level: Level
    at_step: int
    reset_error_feedback: bool


class CompressionHook(StepStatistics, JoinHandling):
    """State and logic of the hook; `compression_hook` is the function DDP calls."""

    def __init__(
        self,
        level: str = "none",
        *,
        group: dist.ProcessGroup | None = None,
        local_batch_size: int | None = None,
        ema_decay: float = 0.9,
        carry_statistics: bool = True,
        seed: int = 0,
    ) -> None:
        """`carry_statistics=False` sends the statistics in an all-reduce of their own at
        every level (the design before 2026-11-25, kept for `bench/hook.py`'s comparison).
        `seed` picks the lowrank levels' starting Q, like torch's `PowerSGDState.random_seed`
        (every rank must pass the same; 0 <= seed < 2^31)."""
        self._lock = threading.Lock()
        self._sum_lock = threading.Lock()
        self._carry_statistics = carry_statistics
        self._group_given = group is not None
        self.wire: Wire
        self.world_size: int
        self._carry: bool
        self._bind(group)
        self._codecs: dict[str, Codec] = {}
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}), got {seed!r}")
        self._seed = seed
        self._level = parse_level(level)
        self._codec = self._codec_for(self._level)
        self._pending: _PendingLevel | None = None
        # bucket index -> (the layout it was made for, the residual)
        self._residuals: dict[int, tuple[Layout, torch.Tensor]] = {}
        # id(parameter) -> its piece, taken once: restored from a checkpoint, or cut from
        # residuals whose layout DDP rebuilt away (residual_layout.take_residual).
        self._pool: dict[int, torch.Tensor] = {}
        self._ema = NoiseScaleEMA(ema_decay)
        self._step = 0
        self._weight = 1.0 / self.world_size
        self._local_batch: int | None = None
        self._global_batch: int | None = None
        if local_batch_size is not None:
            self.set_shares(local_batch_size, local_batch_size * self.world_size)
        self._shares_per_rank = local_batch_size  # "this many on every rank", until set_shares
        self._latest: GradientStats | None = None
        # The last backward's totals while still on their way from the GPU (late_stats.py),
        # and the lock under which they are computed, once.
        self._unpublished: Unpublished | None = None
        self._settle_lock = threading.Lock()
        self._summarised_step = -1
        # Bytes and all-reduce seconds of every backward since the last `step_summary`: a
        # step whose micro-batches all synchronise (accumulation without `no_sync`, a GAN's
        # discriminator run twice) sends each pass's gradients.
        self._unsummarised = (0, 0.0)
        self.stats_failures = 0  # steps whose statistics could not be computed
        self._last_bucket_ready: float | None = None
        self.last_step_records: tuple[WireRecord, ...] = ()
        self._tail: torch.futures.Future | None = None  # None between steps
        # This step's buckets launched so far, and the residuals they consumed: what
        # `abort_step` and a void step need.
        self._seen: set[int] = set()
        self._consumed: dict[int, tuple[Layout, torch.Tensor]] = {}
        self._poison = 0.0
        self._poisoned_step: int | None = None  # the last step some rank aborted
        # The GradScaler scale of the step's backward, read once the step's totals are on the
        # host (the runtime sets it): the noise-scale EMA is kept in the gradient's own units.
        # Called as the backward's totals leave (`_defer`), not when they are read: a
        # number, a `HostValues` holding one (read with them), or None.
        self.loss_scale: Callable[[], Any] | None = None
        # DDP's join (uneven inputs): the next backward is a shadow pass of a rank whose data
        # ran out (`_watch_join`), and the DDP model, whose join settings say how the ranks
        # that did train are averaged (`_averages_over_trained`).
        self._shadow_next = False
        self._ddp: Callable[[], Any] = lambda: None
        self._step_shadow = False
        self._step_share = 1
        self._step_total = self.world_size
        self._step_rescale = False
        self._gates: list[tuple[torch.futures.Future, torch.futures.Future]] = []

    # ----- control, called between steps on every rank alike -----

    @property
    def level(self) -> str:
        return str(self._level)

    @property
    def step(self) -> int:
        """Index of the next step the hook will run (steps counted from 0)."""
        return self._step

    def set_level(
        self, level: str, at_step: int | None = None, *, reset_error_feedback: bool = False
    ) -> None:
        """Switch to `level` at the start of step `at_step` (default: the next step).

        Raises LevelError for an unknown level and ValueError for a step already begun.
        Kept error feedback is carried into the new level (a lossless level flushes it).
        A later call replaces a switch not yet applied.
        """
        parsed = parse_level(level)
        if at_step is not None and (isinstance(at_step, bool) or not hasattr(at_step, "__index__")):
            raise TypeError(f"at_step must be a whole step number, not {at_step!r}")
        target = self._step if at_step is None else operator.index(at_step)
        if target < self._step:
            raise ValueError(f"cannot switch level at step {target}: step {self._step} is next")
        with self._lock:
            self._pending = _PendingLevel(parsed, target, reset_error_feedback)

    def _due(self) -> _PendingLevel | None:
        """The switch the next step applies, if any."""
        pending = self._pending
        return pending if pending is not None and pending.at_step <= self._step else None

    @property
    def next_level(self) -> str:
        """The level the next step runs at: a switch due by then (`set_level`) included."""
        due = self._due()
        return str(due.level if due is not None else self._level)

    def error_feedback(self) -> dict[int, torch.Tensor]:
        """This rank's error feedback as the next step would find it: one flat float32 piece
        per parameter, keyed by id(parameter); empty when a switch due by then resets it.
        Each piece is in the parameter's logical order (as `p.reshape(-1)`, whatever its
        memory format); a complex parameter's is its real view's (`torch.view_as_real`, two
        floats a value). Read between steps (a checkpoint): the tensors are the hook's own,
        never changed in place (each step replaces them)."""
        self.settle()  # a void last step owes back what it consumed
        with self._lock:
            due = self._due()
            if due is not None and due.reset_error_feedback:
                return {}
            residuals = list(self._residuals.values())
            pool = dict(self._pool)
        return {**split_by_parameter(residuals), **pool}

    def restore_error_feedback(self, pieces: dict[int, torch.Tensor]) -> None:
        """Take back `pieces` (as `error_feedback` gave them, on the parameters' device) in
        place of this rank's error feedback: each bucket's next exchange adds the pieces of
        its parameters (zeros for one without), laid into the bucket's memory order, so a
        model restored in another memory format (`channels_last`) gets the same values. A
        piece of the wrong size leaves its whole bucket without a residual (the checkpoint
        loader refuses one first: `runtime/actuator_state.py`). Between steps; each rank
        restores its own."""
        self.settle()  # not to be undone by the last step's late bookkeeping
        with self._lock:
            self._residuals.clear()
            self._pool = dict(pieces)

    @property
    def shares(self) -> tuple[int, int] | None:
        """(local_samples, global_samples) as `set_shares` last set them, or None."""
        local, total = self._local_batch, self._global_batch
        return None if local is None or total is None else (local, total)

    def set_shares(self, local_samples: int, global_samples: int) -> None:
        """This rank contributes `local_samples` of `global_samples` from the next step on."""
        for name, value in (("local_samples", local_samples), ("global_samples", global_samples)):
            # inf of them weighed this rank's gradient 0, silently; 1.5 and True passed too
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise TypeError(f"{name} must be a whole number of samples, not {value!r}")
        local_samples, global_samples = int(local_samples), int(global_samples)
        if global_samples < 1 or not 0 <= local_samples <= global_samples:
            raise ValueError(
                f"shares need 0 <= local_samples <= global_samples and global_samples >= 1, "
                f"got {local_samples} of {global_samples}"
            )
        with self._lock:
            self._weight = local_samples / global_samples
            self._local_batch = local_samples
            self._global_batch = global_samples
            self._shares_per_rank = None

    def latest_stats(self) -> GradientStats | None:
        """Statistics of the last completed step, or None before the first one (on CUDA this
        waits for the step's totals to land if they have not)."""
        self.settle()
        return self._latest

    def noise_terms(self) -> tuple[float, float] | None:
        """The noise-scale EMA's smoothed (tr(Sigma), |G|^2) in the gradient's own units, or
        None before the first estimate (`NoiseScaleEMA.terms`)."""
        self.settle()
        return self._ema.terms()

    def held_noise_terms(self) -> tuple[float, float] | LateStats | None:
        """`noise_terms` without waiting: the terms, or, while the statistics of a step
        already handed out (`step_summary`) are still in flight, that step's `LateStats`,
        whose `noise_terms` are those terms once it is computed."""
        with self._settle_lock:
            pending = self._unpublished
            in_flight = pending is not None and not pending.values.ready()
            if in_flight and pending is not None and pending.summary is not None:
                return pending.summary
        self.settle()  # landed, or never handed out: nothing to wait for that is not owed
        return self._ema.terms()

    def step_summary(self) -> GradientStats | LateStats | None:
        """The collector's `GradientStatsSource` view: each step's statistics once, then None
        until the next backward completes (so a step without a backward reports nothing).
        The statistics are the last backward's; `comm_bytes` and `allreduce_s` add up every
        backward since the last call (a step whose micro-batches all synchronise sends each
        one's gradients; `latest_stats` keeps the last pass's own). On CUDA, while the last
        backward's totals are still in flight, a `LateStats` that computes them when read."""
        pending = self._unpublished
        if pending is not None and pending.values.ready():
            self.settle()
        with self._settle_lock:
            pending = self._unpublished
            if pending is not None:
                if pending.step == self._summarised_step:
                    return None
                self._summarised_step = pending.step
                with self._lock:
                    (nbytes, seconds), self._unsummarised = self._unsummarised, (0, 0.0)
                pending.summary = LateStats(self.settle, pending, nbytes, seconds)
                return pending.summary
        latest = self._latest
        if latest is None or latest.step == self._summarised_step:
            return None
        self._summarised_step = latest.step
        with self._lock:
            (nbytes, seconds), self._unsummarised = self._unsummarised, (0, 0.0)
        if nbytes == latest.comm_bytes:
            return latest
        return dataclasses.replace(latest, comm_bytes=nbytes, allreduce_s=seconds)

    def abort_step(self, step: int, buckets: list[Any]) -> bool:
        """This rank's backward of hook step `step` (`self.step` when that backward began)
        failed part-way (out of memory): launch every bucket of `buckets` (DDP's current
        layout as zero-filled `GradBucket`s: `reducer._get_zeros_like_grad_buckets()`) that
        was not handed over, the last one's statistics marked void, and wait for them. The
        other ranks' collectives are then all matched, and every rank sees the step void
        (`take_void_step`) and runs it again. False (nothing launched) when the step's last
        bucket already went out unmarked (the hook's step has moved past `step`)."""
        if step != self._step or not buckets:
            return False
        if self._tail is None:  # no bucket of this step handed over yet
            self._begin_step()
        self._poison = 1.0
        done = None
        for bucket in sorted(buckets, key=lambda b: b.index()):
            if bucket.index() not in self._seen:
                done = self.on_bucket(bucket)
        if done is None:
            return False
        done.wait()
        return True

    def take_void_step(self) -> int | None:
        """The step some rank aborted (`abort_step`), once; None when there is none. Reads
        the last backward's totals (on CUDA a wait for its last all-reduce, if in flight)."""
        self.settle()
        step, self._poisoned_step = self._poisoned_step, None
        return step

    @classmethod
    def from_config(
        cls, config: Any, *, process_group: dist.ProcessGroup | None = None
    ) -> CompressionHook:
        """Build from a `KernelsConfig`-like object: `.compression` and `.int8_block_size`.

        Raises LevelError naming the bad level.
        """
        return cls(str(configured_level(config)), group=process_group)

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install the hook on `ddp_model`. Every rank calls it at the same point: a model
        built with `find_unused_parameters` gets the hook a process group of its own here
        when it was given DDP's (`hook_group.py`), which is a collective. A hook made without
        a group sums over DDP's group (the whole world unless DDP was given a sub-group)."""
        on_sub_group = ddp_model.process_group is not dist.group.WORLD
        if self._step == 0 and not self._group_given and on_sub_group:
            self._adopt(ddp_model.process_group)
        if self._step == 0 and needs_own_group(ddp_model, self.wire.group):
            self.wire = Wire(own_group(ddp_model))
        ddp_model.register_comm_hook(self, compression_hook)
        self._ddp = weakref.ref(ddp_model)
        self._watch_join(ddp_model)
        # The group is freed at exit, before interpreter finalization (teardown.py), and
        # not by the model's destructor while a gloo thread still finishes a work of ours.
        groups = (ddp_model.process_group, self.wire.group)
        for group in {id(g): g for g in groups if g is not None}.values():
            keep_until_exit(group)

    def _bind(self, group: dist.ProcessGroup | None) -> None:
        self.wire = Wire(group)
        self.world_size = self.wire.world_size
        # Carried in float32 (exact integers below 2^24), the flags (`_stats_scalars`) pack
        # two counts of at most W each, the ranks that trained plus W + 1 times the ranks
        # that aborted: summed, at most (W + 1)^2 - 1. A third count (the ranks in a join's
        # shadow pass) would need (W + 1)^3 < 2^24; lowrank counts those in its own first
        # all-reduce instead (codecs/lowrank.py), where the count is there before decoding.
        self._carry = self._carry_statistics and (self.world_size + 1) ** 2 < 2**24

    def _adopt(self, group: dist.ProcessGroup) -> None:
        """A hook made without a group, registered on a DDP model of a sub-group (pipeline
        plus data parallelism): it sums over DDP's group, not the whole world, which summed
        other groups' models into this one's gradients."""
        self._bind(group)
        if self._local_batch is None:
            self._weight = 1.0 / self.world_size
        elif (per_rank := self._shares_per_rank) is not None:
            self.set_shares(per_rank, per_rank * self.world_size)
            self._shares_per_rank = per_rank

    # ----- the step, driven by DDP -----

    def _codec_for(self, level: Level) -> Codec:
        name = str(level)
        if name not in self._codecs:
            self._codecs[name] = make_codec(level, seed=self._seed)
        return self._codecs[name]

    def _begin_step(self) -> None:
        # The last backward's statistics before this one consumes residuals: a void step
        # owes back what it took, and the noise-scale EMA moves in step order.
        self.settle()
        with self._lock:
            pending = self._pending
            if pending is not None and pending.at_step <= self._step:
                self._pending = None
                self._level = pending.level
                self._codec = self._codec_for(pending.level)
                if pending.reset_error_feedback:
                    self._residuals.clear()
                    self._pool.clear()
                    self._codec.reset()
            self._step_weight = self._weight
            self._step_local_batch = self._local_batch
            self._step_global_batch = self._global_batch
        # This pass's share of the step's samples: none for a shadow pass of DDP's join; one
        # of W where the shares are unknown (the weights are 1 / W then).
        self._step_shadow, self._shadow_next = self._shadow_next, False
        local, total = self._step_local_batch, self._step_global_batch
        if local is None or not total:
            local, total = 1, self.world_size
        # 0 too where the actuator gave this rank no sample this step
        self._step_share = 0 if self._step_shadow else local
        self._step_total = total
        self._step_rescale = not self._step_shadow and self._averages_over_trained()
        self._gates = []
        self._t0 = time.perf_counter()
        # Accumulated as tensors on the gradients' device: no host sync per bucket on CUDA.
        self._local_sq: torch.Tensor | float = 0.0
        # Each bucket's |sum|^2, added up where the step's totals leave: on CUDA each was
        # computed on its own continuation's stream, ordered only before that point.
        self._bucket_sq: list[torch.Tensor] = []
        self._reduced_at = self._t0
        self._launched: list[torch.futures.Future] = []  # this step's buckets, launched at once
        self.wire.records.clear()
        self._tail = completed(None)
        self._seen = set()
        self._consumed = {}
        self._poison = 0.0

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self._tail is None:
            self._begin_step()
        assert self._tail is not None
        grad = bucket.buffer()
        key = bucket.index()
        parameters = bucket.parameters()
        # Only a codec that plans by shape reads them (85 us a step for 200 parameters).
        shapes = bucket_shapes(parameters) if self._codec.plans_by_shape else None
        layout = layout_of(parameters)
        local_sq = squared_norm(grad.detach())
        if grad.dtype == torch.float64 and not self._codec.keeps_float64 and grad.numel():
            local_sq = _past_float32(grad.detach(), self._step_weight, local_sq)
        self._local_sq = self._local_sq + local_sq
        # A shadow pass of DDP's join trained nothing: it sends exactly 0 at every level
        # (`Codec.reduce_shadow`) and neither spends nor replaces its error feedback, which
        # waits for its next real step (before, its residual went into the others' sum).
        shadow = self._step_shadow
        kept = None
        if not shadow:
            with self._lock:  # an earlier bucket's `absorb` may be keeping its residual now
                kept = take_residual(self._residuals, self._pool, key, layout, self._seen)
        residual = None
        if kept is not None:
            self._consumed[key] = kept  # by this bucket's index: unique within the step
            # DDP rebuilt its buckets after step 0: the residual follows its parameters.
            residual = fit_residual(kept[1], kept[0], layout)
            if residual is not None and residual.shape != grad.shape:
                residual = None
        codec, weight, wire = self._codec, 0.0 if shadow else self._step_weight, self.wire
        carry = None  # the statistics, when they ride in this (the last) bucket's collective
        carrier = codec if isinstance(codec, CarryingCodec) and self._carry else None
        if bucket.is_last() and carrier is not None and carrier.can_carry(grad):
            carry = self._stats_scalars(grad.device).to(torch.float32)
        carried: list[torch.Tensor] = []
        devices = future_devices(grad)  # the futures made here hold tensors on grad's device

        # On CUDA a chained level launches from a continuation, on a stream that waited only
        # for the previous bucket: it must also wait for what this thread queued for this one.
        ready = None if codec.launches_at_once else _stream_mark(grad)

        def launch(_: object) -> torch.futures.Future:
            _wait_for(ready, grad.device)
            if carrier is not None and carry is not None:  # in a shadow pass: weight 0
                return carrier.reduce_carrying(grad, weight, residual, key, wire, carry)
            if shadow:
                return codec.reduce_shadow(grad, key, wire, shapes)
            return codec.reduce(grad, weight, residual, key, wire, shapes)

        def absorb(result: CodecResult) -> torch.Tensor:
            if result.residual is not None and not shadow:
                with self._lock:
                    self._residuals[key] = (layout, result.residual)
            if result.extra is not None:
                carried.append(result.extra)
            sq = squared_norm(result.summed)
            with self._sum_lock:  # launched at once, buckets may complete on two gloo threads
                self._bucket_sq.append(sq)
                self._reduced_at = max(self._reduced_at, time.perf_counter())
            return result.summed.to(grad.dtype)

        if codec.launches_at_once:
            # DDP hands buckets over in index order on every rank, so launching here keeps
            # the collectives in the same order everywhere, without a chain's extra hops.
            reduced = _launch_now(launch, devices)
        else:
            reduced = chain(self._tail, launch, devices)
        self._seen.add(key)  # launched (or chained): `abort_step` must not launch it again
        if not bucket.is_last():
            done = for_ddp(reduced, absorb)
            if codec.launches_at_once:
                self._launched.append(done)
            self._tail = done
            if self._step_rescale:  # DDP gets it once the step's share of samples is known
                gate: torch.futures.Future = torch.futures.Future(devices=devices)
                self._gates.append((done, gate))
                return for_ddp(gate, _same)
            return done
        done = follow(reduced, absorb, devices)
        # The step ends here, on this (the backward) thread: the chain may already have run
        # to completion inline, so no continuation may own the step boundary.
        self._last_bucket_ready = time.perf_counter()
        step, level = self._step, str(self._level)
        self._step += 1
        self._tail = None
        # Where DDP averages over the samples trained and some rank sat the step out (join),
        # every bucket's sum is scaled once the statistics say by how much (`_scaled`): the
        # other buckets reach DDP through gates opened then (`_open_gates`).
        gates, scaling = self._gates, _Scaling(self._step_rescale, self._step_total)
        self._gates = []
        if carry is not None:
            # The statistics arrived with the last bucket. Gloo may finish buckets out of
            # order, so they are published once every bucket of the step is summed.
            every = torch.futures.collect_all([*self._launched, done])
            publish = functools.partial(
                self._publish_carried, carried=carried, step=step, level=level, scaling=scaling
            )
            last = follow(every, publish, devices)
        elif codec.launches_at_once:
            # Every bucket is launched: the statistics' all-reduce goes right behind them, in
            # flight beside the last bucket's rather than one round trip after it.
            stats = self.wire.all_reduce(self._stats_scalars(grad.device))
            every = torch.futures.collect_all([*self._launched, done, stats])
            publish = functools.partial(self._publish_both, step=step, level=level, scaling=scaling)
            last = follow(every, publish, devices)
        else:
            finish = functools.partial(
                self._finish_step, step=step, level=level, ready=ready, scaling=scaling
            )
            last = chain(done, finish, devices)
        if gates:  # opened whatever happened to the last bucket: DDP waits for each
            last.add_done_callback(lambda _: _open_gates(gates, scaling.factor))
        return for_ddp(last, _same)

    def settle(self) -> None:
        """Compute the statistics of the last backward if its totals are still unread,
        waiting for their copy alone if it has not landed. Idempotent; any thread."""
        with self._settle_lock:
            pending, self._unpublished = self._unpublished, None
            if pending is None:
                return
            try:
                self._apply(pending, pending.values.floats())
            except Exception:  # noqa: BLE001 - statistics must never fail the step
                self.stats_failures += 1
            finally:
                pending.done = True


def compression_hook(state: CompressionHook, bucket: dist.GradBucket) -> torch.futures.Future:
    """The function registered with DDP: ``ddp.register_comm_hook(hook, compression_hook)``."""
    return state.on_bucket(bucket)


# DDP compares the hook's annotations with the real classes, and this module's postponed
# annotations are strings; give DDP the objects it checks for.
compression_hook.__annotations__ = {
    "state": CompressionHook,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
