"""Session: one rank's trainspec: the collector, the step boundary, the hooks, shutdown."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainspec.collector import Collector, EventRecord, StepRecord
from trainspec.collector.gradients import GradientFigures, GradientStatsSource
from trainspec.collector.samplers.latency import LatencyProbeSampler
from trainspec.config import TrainspecConfig
from trainspec.host_copy import HostValues, single_float
from trainspec.runtime import arguments, loss_scale
from trainspec.runtime.groups import SideGroups
from trainspec.runtime.identity import RankIdentity
from trainspec.runtime.step_timer import HostPhaseClock, StepTiming
from trainspec.runtime.step_values import StepValues

log = logging.getLogger("trainspec.runtime")

_UNREAD_CLOCK = HostPhaseClock()  # times the steps whose records nothing reads


@dataclass
class _Pending:
    """A step whose timings may still be in flight on the device."""

    step: int
    timing: StepTiming
    wall_start: float
    wall_end: float
    data_wait_s: float
    samples: int
    tokens: int | None
    loss: HostValues | None  # on its way to the host (host_copy.py): no device sync
    grads: GradientFigures | None
    backward_end: float | None
    loss_scale: Any = None  # the GradScaler's scale in this step's backward (loss_scale.py)

    def ready(self) -> bool:
        """The step's device work is done and its values have reached the host."""
        grads_ready = getattr(self.grads, "ready", None)
        return (
            self.timing.ready()
            and (self.loss is None or self.loss.ready())
            and (grads_ready is None or grads_ready())
        )


class StepContext:
    """The body of one optimizer step: `with session.step(samples=B) as s: ...`.

    `recorded` is False for a step that is timed but never stored: one opened inside another
    step, or after `close()`. `phase()` blocks are optional: a step that marks none is timed
    by the hooks `wrap` put on the model and optimizer (runtime.phase_hooks)."""

    def __init__(
        self, session: Session, samples: int, tokens: int | None, *, recorded: bool = True
    ) -> None:
        self.session = session
        self.samples = samples
        self.tokens = tokens
        self.recorded = recorded
        self.scoped = False  # opened by `session.step()` (a block), not `begin_step()`
        self.loss: Any = None
        self.timing = StepTiming(session.step_clock())
        self.backward_end: float | None = None
        self.wall_start = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.timing.begin(name)
        try:
            yield
        finally:
            self.timing.end(name)
            if name == "backward":
                self.backward_end = time.perf_counter()
                after = getattr(self.session.grad_source, "after_backward", None)
                if after is not None:  # micro-step statistics (single process, accumulation)
                    after()


@dataclass
class Session:
    config: TrainspecConfig
    identity: RankIdentity
    run_id: str
    run_dir: Path
    collector: Collector | None
    groups: SideGroups | None
    clock: Any
    flops_per_sample: float = 0.0
    probe: LatencyProbeSampler | None = None
    # trainspec's gradient hook goes on this rank's DDP models: agreed by every rank at init
    # (runtime/rank_terms.py), so one rank's collector being off does not change the wire
    hooks_gradients: bool = False
    # this rank joins the operator actions' broadcast (rank 0 has an agent endpoint)
    operator_actions: bool = False
    grad_source: GradientStatsSource | None = None
    step_index: int = 0
    _data_wait: float = 0.0
    _data_start: float | None = None
    _pending: deque[_Pending] = field(default_factory=deque)
    _closed: bool = False
    boundary_hooks: list[Any] = field(default_factory=list)
    record_listeners: list[Any] = field(default_factory=list)  # called with each StepRecord
    hook: Any = None  # the gradient hook, or a HookSet over several models' hooks
    _hooks: list[tuple[Any, set[int]]] = field(default_factory=list)  # (hook, parameter ids)
    _actuated: bool = False  # actuate() has taken the hooks there were
    phase_hooks: Any = None  # runtime.phase_hooks.PhaseHooks, once `wrap` has hooked a model
    _shares_known: bool = False
    _open_step: StepContext | None = None
    _boundary_owed: bool = False
    _misuse_warned: set[str] = field(default_factory=set)
    _joined_at: int | None = None  # the step at which DDP's join last noted this rank out
    _values: StepValues = field(init=False)  # what the step's statistics and loss store as

    def __post_init__(self) -> None:
        self._values = StepValues(self.event)

    def records_read(self) -> bool:
        """Whether anything reads the steps' records: the collector, or a listener (the
        actuator's controller). With neither (trainspec off), a step times itself on the
        host clock and copies nothing to the host: off costs next to nothing."""
        return self.collector is not None or bool(self.record_listeners)

    def step_clock(self) -> Any:
        """The clock a step begun now is timed on: the session's (CUDA events on a GPU) when
        its record is read, else the host's (nothing reads the marks, and an event costs
        microseconds of the training thread's time)."""
        return self.clock if self.records_read() else _UNREAD_CLOCK

    # -- data ----------------------------------------------------------------------------
    def iter_data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from `iterable`, timing each `next()` as the next step's data wait."""
        it = iter(iterable)
        while True:
            t0 = time.perf_counter()
            wall0 = time.time()
            try:
                item = next(it)
            except StopIteration:
                return
            self._data_wait += time.perf_counter() - t0
            if self._data_start is None:
                self._data_start = wall0
            yield item

    # -- the step boundary -----------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, *, samples: int, tokens: int | None = None) -> Iterator[StepContext]:
        """One optimizer step. A body that raises is not recorded as a step: it is stored as a
        `fault` event (`step_failed`), and its step-boundary hooks, whose collectives the
        other ranks may never join, wait for the next step (`fail_step`). A step opened inside
        this one is not recorded."""
        ctx = self._begin(samples, tokens, scoped=True)
        try:
            yield ctx
        except BaseException as exc:
            self.fail_step(ctx, exc)
            raise
        self.end_step(ctx)

    def begin_step(self, *, samples: int = 0, tokens: int | None = None) -> StepContext:
        """Open a step by hand (what `step()` does; used by the zero-code instrumentation).
        A step begun by hand and never ended is dropped when the next one begins."""
        return self._begin(samples, tokens, scoped=False)

    @property
    def open_step(self) -> StepContext | None:
        """The recorded step running now, if any (none after `close()`)."""
        return None if self._closed else self._open_step

    def discard_step(self, ctx: StepContext) -> None:
        """Drop `ctx`, a step begun by hand and still open, unrecorded and without a
        warning (the zero-code layer hands over to a script that measures itself)."""
        if self._open_step is ctx:
            self._open_step = None

    def _begin(self, samples: Any, tokens: Any, *, scoped: bool) -> StepContext:
        """A step opened after `close()`, or inside a `step()` block, runs untouched but is
        not recorded (a warning says so, once)."""
        samples = arguments.count("samples", samples)
        tokens = arguments.optional_count("tokens", tokens)
        if self._closed:
            self._warn_misuse("closed", "a step after close() is not recorded")
            return StepContext(self, samples, tokens, recorded=False)
        if self._open_step is not None:
            if self._open_step.scoped:
                self._warn_misuse(
                    "nested", "a step opened inside another step is not recorded (the outer is)"
                )
                return StepContext(self, samples, tokens, recorded=False)
            self._warn_misuse("abandoned", "a step begun by hand was never ended; it is dropped")
        if self._boundary_owed:  # the failed step's boundary, on the way into the next
            self._boundary_owed = False
            self._run_boundary_hooks()
        ctx = StepContext(self, samples, tokens)
        ctx.scoped = scoped
        ctx.wall_start = self._data_start if self._data_start is not None else time.time()
        self._open_step = ctx
        if samples:
            self.share_batch(samples)
        return ctx

    def _warn_misuse(self, kind: str, message: str) -> None:
        if kind not in self._misuse_warned:
            self._misuse_warned.add(kind)
            log.warning("trainspec: %s", message)

    def fail_step(self, ctx: StepContext, exc: BaseException) -> None:
        """Close a step whose body raised `exc`: nothing is recorded as a step, its gradient
        statistics and data wait are dropped, and a `fault` event names the exception. Never
        raises (the script's own exception is what propagates).

        The step still counts (`step_index` moves on) and its boundary is owed: the boundary
        hooks run when the next step begins, not now. So a rank that is on its way out does
        not start the hooks' collectives, and a script that catches the exception and goes on
        stays in step with the ranks whose step finished."""
        if not ctx.recorded or self._open_step is not ctx:
            return
        self._open_step = None
        self._data_wait, self._data_start = 0.0, None
        if not self._closed:
            self._record_failure(exc)
        self.step_index += 1
        self._boundary_owed = True

    def _record_failure(self, exc: BaseException) -> None:
        try:
            if self.grad_source is not None:
                self.grad_source.step_summary()  # this step's statistics, if any, are void
            severity = "error" if isinstance(exc, Exception) else "warning"
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                severity = "info"  # sys.exit(0) inside a step: a clean exit, not a fault
            text = str(exc)
            reason = f"{type(exc).__name__}: {text}"[:500] if text else type(exc).__name__
            self.event("fault", "step_failed", reason, severity=severity)
        except Exception as record_exc:  # telemetry never replaces the script's exception
            log.warning("trainspec: could not record a failed step: %s", record_exc)

    def note_joined(self) -> None:
        """DDP's join (`ddp.join()`, uneven inputs): this rank's data ran out, and it shadows
        the steps the other ranks still train (`hook_wiring.watch_join`). Said once, as an
        `uneven_inputs` anomaly at the step it would run next: its steps end there while the
        others' go on, which `trainspec validate` tells from a rank killed with its last rows
        unstored."""
        if self._closed or self._joined_at == self.step_index:
            return
        self._joined_at = self.step_index
        self.event(
            "anomaly", "uneven_inputs",
            "this rank's data ran out (DDP's join): it shadows the steps the other ranks "
            "still train, and stores none of them",
        )  # fmt: skip

    def share_batch(self, samples: int) -> None:
        """Tell the gradient hook this rank's batch before the first backward: equal shares
        (every rank calls this with its batch at step 0) until the actuator sets others."""
        if self.hook is not None and not self._shares_known:
            self.hook.set_shares(samples, samples * self.identity.world_size)
            self._shares_known = True

    def manage_shares(self) -> None:
        """Someone else (the actuator's sampler) sets the hook's shares from now on."""
        self._shares_known = True

    def end_step(self, ctx: StepContext, *, wall_end: float | None = None) -> None:
        """Close a step: queue its record, then run the step-boundary hooks. A step that is
        not recorded (nested, or opened after `close()`) or that ends after `close()` does
        neither."""
        if not ctx.recorded or self._open_step is not ctx:
            return
        self._open_step = None
        if self._closed:
            self._warn_misuse("closed", "a step that ends after close() is not recorded")
            return
        wall_start = ctx.wall_start
        if self.phase_hooks is not None:  # phases from the model's and optimizer's hooks
            self.phase_hooks.settle(ctx)
        # Taken whether or not a record is made: the sources hold one step's figures each.
        grads = self.grad_source.step_summary() if self.grad_source is not None else None
        scale = loss_scale.take()
        if self.records_read():  # else nothing reads it: no record, no copy of the loss
            self._pending.append(
                _Pending(
                    step=self.step_index,
                    timing=ctx.timing,
                    wall_start=wall_start,
                    wall_end=time.time() if wall_end is None else wall_end,
                    data_wait_s=self._data_wait,
                    samples=ctx.samples,
                    tokens=ctx.tokens,
                    loss=self._loss_of(ctx.loss),
                    grads=grads,
                    backward_end=ctx.backward_end,
                    loss_scale=scale,
                )
            )
        self._data_wait, self._data_start = 0.0, None
        self.step_index += 1
        self._emit_ready()
        self._run_boundary_hooks()

    def _loss_of(self, loss: Any) -> HostValues | None:
        """The step's loss on its way to the host; a value that is no number (a string, a
        tensor of several) is not stored, and said once (it was dropped without a word)."""
        values = _loss_values(loss)
        if loss is not None and values is None:
            shape = getattr(loss, "shape", None)
            what = f"a tensor of shape {tuple(shape)}" if shape is not None else repr(loss)[:40]
            self._warn_misuse(
                "loss", f"a step's loss must be one number, not {what}: its loss is not stored"
            )
        return values

    def _run_boundary_hooks(self) -> None:
        for hook in list(self.boundary_hooks):
            try:
                hook(self.step_index)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # telemetry and control never take the step down
                # (BaseException: torch's CheckpointException is one)
                self.boundary_hooks.remove(hook)
                log.warning("trainspec: step-boundary hook %r failed and is off: %s", hook, exc)
                self.event(
                    "fault", "boundary_hook", f"{type(exc).__name__}: {exc}", severity="error"
                )

    def _emit_ready(self, *, force: bool = False) -> None:
        while self._pending and (force or self._pending[0].ready()):
            p = self._pending.popleft()
            if self.collector is None and not self.record_listeners:
                continue
            record = self._step_record(p)
            if self.collector is not None:
                self.collector.record_step(self._values.stored(record))
            for listener in self.record_listeners:  # the actuator sees a NaN loss as it is
                listener(record)

    def _step_record(self, p: _Pending) -> StepRecord:
        phases = p.timing.seconds()
        duration = p.wall_end - p.wall_start
        g = self._values.gradients(p.step, p.grads, p.loss_scale, self.grad_source)
        exposed = None
        if g.last_bucket_ready is not None and p.backward_end is not None:
            exposed = max(0.0, p.backward_end - g.last_bucket_ready)
        throughput = p.samples / duration if duration > 0 else None
        mfu = None
        peak = self.config.collector.peak_flops
        if peak > 0 and self.flops_per_sample > 0 and throughput:
            mfu = min(1.0, self.flops_per_sample * throughput / peak)
        return StepRecord(
            ts=p.wall_end,
            rank=self.identity.rank,
            step=p.step,
            duration_s=duration,
            data_wait_s=p.data_wait_s,
            forward_s=phases.get("forward"),
            backward_s=phases.get("backward"),
            optimizer_s=phases.get("optimizer"),
            comm_exposed_s=exposed,
            allreduce_s=g.allreduce_s,
            samples=p.samples,
            tokens=p.tokens,
            throughput=throughput,
            loss=single_float(p.loss),
            mfu=mfu,
            grad_norm=g.grad_norm,
            grad_variance=g.grad_variance,
            grad_noise_scale=g.grad_noise_scale,
            comm_bytes=g.comm_bytes,
            compression=g.compression,
        )

    # -- events ----------------------------------------------------------------------------
    def event(
        self,
        kind: str,
        name: str,
        reason: str,
        *,
        severity: str = "info",
        evidence: dict[str, Any] | None = None,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> None:
        """Record an event at `step` (default: the step running now)."""
        arguments.event_fields(
            kind, name, reason, severity, {"evidence": evidence, "before": before, "after": after}
        )
        if self.collector is None:
            return
        self.collector.record_event(
            EventRecord(
                ts=time.time(),
                rank=self.identity.rank,
                step=self.step_index if step is None else step,
                kind=kind,
                name=name,
                reason=reason,
                severity=severity,
                evidence=evidence or {},
                before=before,
                after=after,
            )
        )

    # -- actuator ------------------------------------------------------------------------
    def actuate(self, *, dataset_len: int, global_batch: int, **kwargs: Any) -> Any:
        """The share sampler, fault injector and controller for this loop; see runtime.actuation."""
        from trainspec.runtime.actuation import attach

        actuation = attach(self, dataset_len=dataset_len, global_batch=global_batch, **kwargs)
        self._actuated = True
        return actuation

    # -- model ---------------------------------------------------------------------------
    def wrap(
        self,
        model: Any,
        *,
        optimizer: Any = None,
        micro_batch_size: int | None = None,
        **ddp_kwargs: Any,
    ) -> Any:
        """DDP-wrap `model` (when distributed) with trainspec's gradient hook; see wrap_model."""
        return wrap_model(
            self, model, optimizer=optimizer, micro_batch_size=micro_batch_size, **ddp_kwargs
        )

    def attach_hook(self, ddp_model: Any) -> GradientStatsSource | None:
        """Register the kernels' communication hook on a DDP model; returns the session's
        statistics source. A model that has it already (DDP takes one hook, once) keeps it.
        With a second model the session drives every model's hook as one (`HookSet`): what
        holds `session.hook` from before (an `actuate` set up earlier) keeps the first."""
        from trainspec.runtime.hook_set import HookSet
        from trainspec.runtime.hook_wiring import HOOKED, register_gradient_hook, watch_join

        if HOOKED in vars(ddp_model):
            return self.hook
        hook = register_gradient_hook(self, ddp_model)
        vars(ddp_model)[HOOKED] = hook
        watch_join(self, ddp_model, hook)
        if hook is None:
            return self.hook
        if self._hooks and self._actuated:
            self._join_late(hook)
        self._hooks.append((hook, {id(p) for p in ddp_model.parameters()}))
        hooks, ids = [h for h, _ in self._hooks], [i for _, i in self._hooks]
        self.hook = hooks[0] if len(hooks) == 1 else HookSet(hooks, ids)
        return self.hook

    def _join_late(self, hook: Any) -> None:
        """A model wrapped after `actuate()`: the actuator holds the hooks it found then.
        The new one starts at their shares and level, and the user is told the rest."""
        first = self._hooks[0][0]
        if first.shares is not None:
            hook.set_shares(*first.shares)
        hook.set_level(first.next_level)
        log.warning(
            "trainspec: a DDP model wrapped after actuate() starts at the current shares "
            "and compression level, but the actuator's later rebalancing, level switches and "
            "checkpoints reach only the models wrapped before it: wrap every model first"
        )

    # -- shutdown --------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand everything measured so far to the sinks now (on the calling thread)."""
        self._emit_ready()
        if self.collector is not None:
            self.collector.flush()

    @property
    def closed(self) -> bool:
        return self._closed

    def abandon_in_child(self) -> None:
        """In a forked child: this copy is closed without a flush (the parent flushes its
        own) and records nothing more. Its copies of the journal's descriptors are closed:
        they kept the parent's journal locked, as if alive, after the parent was killed."""
        self._closed = True
        self._pending.clear()
        journal = self.collector.journal if self.collector is not None else None
        if journal is not None:
            journal.forget_in_child()

    def close(self, *, aligned: bool = True, timeout_s: float = 10.0) -> None:
        """Flush everything and stop. `aligned`: every rank calls this at the same point
        (normal exit), so the latency probes can stop in step; a signal path passes False.
        A close while an exception propagates (a script's `finally:` after its own error)
        does not align: the other ranks are still training, and waiting for them would
        hold this rank's exit, and so the launcher's restart, for `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        if aligned and _error_in_flight():
            aligned = False
        if self.phase_hooks is not None:  # torch's global optimizer hooks among them
            self.phase_hooks.remove()
        try:
            try:
                self.clock.sync()
            except Exception as exc:  # a failed device must not stop the flush of what we have
                log.warning("trainspec: device sync at close failed: %s", exc)
            self._emit_ready(force=True)
            if aligned and self.probe is not None and self.groups is not None:
                self.probe.stop_aligned(self.groups.control, timeout_s=timeout_s)
        finally:
            # Always: it stops the collector's threads (the probe's waiter among them), which
            # must not outlive this call into interpreter shutdown, and flushes what is left.
            if self.collector is not None:
                self.collector.close(timeout_s=timeout_s)


def _error_in_flight() -> bool:
    """Whether the caller runs while an exception propagates or is being handled (a
    `finally:` or `except:` block); a plain `sys.exit(0)` is a normal end."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return exc is not None


def _loss_values(loss: Any) -> HostValues | None:
    """The step's loss on its way to the host; None for none, or for a tensor that is not one
    value (no loss to store, nothing to copy)."""
    return HostValues(loss) if loss is not None and _one_number(loss) else None


def _one_number(value: Any) -> bool:
    """A tensor of one element, or what `float()` takes that is not text."""
    if hasattr(value, "numel"):
        return bool(value.numel() == 1)
    if isinstance(value, (str, bytes)):
        return False
    try:
        float(value)
    except Exception:  # noqa: BLE001 - whatever a __float__ raises: not a number
        return False
    return True


def wrap_model(
    session: Session,
    model: Any,
    *,
    optimizer: Any = None,
    micro_batch_size: int | None = None,
    **ddp_kwargs: Any,
) -> Any:
    """Wrap `model` in DDP when distributed, and attach the gradient statistics source.

    With DDP, trainspec's communication hook carries the gradients (compression level and
    uneven-share weighting) and reports their statistics. Single process: the gradient norm
    is read by an optimizer pre-step hook, after backward and before the update (with no
    `optimizer`, at the step of any optimizer of the model's parameters); with
    `micro_batch_size` given, every backward is a micro-step and the variance and noise
    scale are estimated across them. A step that marks no phase of its own is timed by
    hooks on the returned model and the optimizer (runtime.phase_hooks).
    """
    import torch
    import torch.distributed as dist

    from trainspec.collector.gradients import ParameterGradientNorm
    from trainspec.runtime.phase_hooks import watch_phases

    # Named here: None failed deep inside (a weak reference, `named_parameters`), a string
    # micro-batch size in a comparison.
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}"
        )
    if micro_batch_size is not None and arguments.count("micro_batch_size", micro_batch_size) < 1:
        raise ValueError("micro_batch_size must be >= 1, not 0")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            model = DistributedDataParallel(model, **ddp_kwargs)
        if session.hooks_gradients:  # collector off on every rank: plain DDP, nothing of ours
            session.grad_source = session.attach_hook(model)
        if session.collector is not None:
            watch_phases(session, model, optimizer)
        return model
    if session.collector is None:
        return model
    # Hooked before the statistics' own pre-step hook: the step's last automatic backward
    # ends (a micro-step observed) before they are read.
    phases = watch_phases(session, model, optimizer)
    from trainspec.runtime.microsteps import MicroStepGradients

    earlier = session.grad_source  # a model wrapped before this one, if any
    if micro_batch_size is None and isinstance(earlier, ParameterGradientNorm):
        update = earlier.watch(model.parameters())  # a second model: the norm covers both
    elif micro_batch_size is not None:
        micro = MicroStepGradients(model.parameters(), micro_batch_size)
        session.grad_source, update = micro, micro.before_update
    else:
        norm = ParameterGradientNorm(model.parameters())
        session.grad_source, update = norm, norm.capture
    if isinstance(earlier, (ParameterGradientNorm, MicroStepGradients)) and (
        session.grad_source is not earlier
    ):
        log.warning(
            "trainspec: gradient statistics now cover the model wrapped last only (in one "
            "process, several models' norms combine where none is wrapped with "
            "micro_batch_size)"
        )
    if optimizer is not None:
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: update())
    else:
        phases.before_update(model.parameters(), update)
    return model
