"""One step's share run as micro-batches with gradient accumulation, retried smaller on OOM.

`MicroBatchRunner.run` cuts the share by the rank's `MicroBatchPlan`, runs every micro-batch
but the last under DDP's `no_sync()` (their backward only accumulates `.grad` locally) and
the last outside it (its backward launches the buckets' all-reduce: one round of
communication per step, whatever the number of micro-batches), and weights each mean loss by
its size / n_r so the accumulated gradient is the share's.

Out of memory (`torch.OutOfMemoryError`, or a RuntimeError saying "out of memory" from older
torch and CPU allocators): the retry is local, so it is only sound while this rank has taken
part in no collective of the step's gradient exchange. That holds for an OOM in any
micro-batch's forward and in every backward run under `no_sync()`: nothing has been sent.
It does not hold for the last micro-batch's backward, where DDP may already have launched
bucket all-reduces that the other ranks are now matching: retrying alone would pair this
rank's next collectives with the wrong ones. There the gradient hook (`exchange`, the
kernels' CompressionHook) completes the step's exchange instead: it launches every bucket DDP
had not handed over, with zeros, and marks the step's statistics all-reduce void, so every
rank's collectives are matched and every rank learns that the step is void; DDP's reducer is
reset on every rank (which makes DDP rebuild its buckets, a collective, on every rank alike
after the next backward), and every rank runs the whole step again (this one smaller), so
no sample is lost and no update is made from the void sums. The exchange is completed after
the except block, once the failed attempt's activations are released. Without the hook
(collector off), when the step's last bucket had already gone out, or at the minimum
micro-batch, it raises `StepOutOfMemoryError` (the job stops, as it would without
trainspec; a restart from the last checkpoint is the remedy). After a retry this rank's micro-batch is smaller
than its peers'; that is still exact (accumulation is local) and the controller reconciles
every rank to the smallest at its next window (actuator/memory_policy.py).

DDP detail: `_pre_forward` broadcasts module buffers on the first forward after a synced one
(`require_forward_param_sync`); the failed attempt already did that broadcast for this step,
so it is switched off before the retry, or this rank would broadcast twice. Residual risk:
an OOM raised inside `_pre_forward` before that broadcast (DDP's one-time bucket rebuild)
would leave the broadcast owed; it is not handled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from trainspec.actuator.micro_batch import (
    MicroBatch,
    MicroBatchPlan,
    accumulation_steps,
    effective,
)
from trainspec.runtime.hook_wiring import hook_of, is_hooked

ForwardFn = Callable[[MicroBatch], Any]  # micro-batch -> its mean loss (a scalar tensor)
EmitFn = Callable[..., None]  # session.event(kind, name, reason, *, severity, evidence, ...)


class StepOutOfMemoryError(RuntimeError):
    """An out-of-memory error this rank cannot retry alone (see the module docstring)."""


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class MicroBatchRunner:
    """Runs a step's micro-batches for one rank; `retry=False` lets an OOM propagate as is."""

    def __init__(
        self,
        plan: MicroBatchPlan,
        *,
        rank: int,
        emit: EmitFn | None = None,
        retry: bool = True,
        exchange: Any = None,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.emit = emit
        self.retry = retry
        # The gradient hook: step, abort_step(step), take_void_step(). With several models
        # (a HookSet) the one on the model a step runs (`_exchange_of`).
        self.exchange = exchange
        self.retries = 0
        self.redone = 0  # steps run again because a rank aborted the exchange
        self._exchange_step = -1
        self.last_split: list[MicroBatch] = []
        self.where: tuple[int, str] = (0, "forward")  # micro-batch index and phase now running

    def run(self, step: int, n: int, forward: ForwardFn, *, model: Any, timer: Any = None) -> Any:
        """Forward and backward over the share's n samples; returns the share's mean loss
        (detached). Raises StepOutOfMemoryError when an OOM cannot be retried locally, and
        any other error of `forward` or backward unchanged."""
        while True:
            micro = self.plan.split(n)
            try:
                total = self._run_once(micro, forward, model, timer)
            except Exception as exc:
                if not self.retry or not is_out_of_memory(exc):
                    raise
                index, phase = self.where
                failed = micro[index]
                shared = failed.last and phase == "backward" and _distributed(model)
                before = (failed.size, len(micro))
                if not (shared and failed.size > self.plan.minimum):
                    if not self.plan.shrink_after_oom(failed.size):
                        raise StepOutOfMemoryError(
                            f"out of memory at step {step} on rank {self.rank} with a "
                            f"micro-batch of {failed.size}, the minimum "
                            f"(actuator.min_micro_batch) ({exc})"
                        ) from exc
                    shared = False  # retried alone
                error = f"{type(exc).__name__}: {exc}"
            else:
                if self._void_step(model) is None:
                    return total
                # Another rank ran out of memory in its last backward: this step's sums are
                # void on every rank, so it runs again (this rank's micro-batch unchanged).
                del total
                # The aborting rank reset its reducer, which makes DDP rebuild its buckets
                # after the next backward (a collective): every rank resets alike.
                model.reducer._reset_state()
                self._reset(model, broadcast_done=False)
                self.redone += 1
                self._record_redo(step)
                continue
            # Out of the except block: the traceback (and the activations it holds) is gone,
            # so completing the exchange below allocates into freed memory.
            if shared:
                _empty_cache()
                if not self._abort_exchange(model):
                    raise StepOutOfMemoryError(
                        f"out of memory in the last micro-batch's backward at step {step} on "
                        f"rank {self.rank}: gradient buckets may already be in all-reduce and "
                        "the step's exchange cannot be completed from here (no gradient hook, "
                        "or its last bucket already sent); restart from the last checkpoint "
                        f"with a smaller actuator.micro_batch ({error})"
                    )
                self.plan.shrink_after_oom(failed.size)
            self._reset(model, broadcast_done=not shared)
            self.retries += 1
            self._record(step, n, index, phase, before)

    def _abort_exchange(self, model: Any) -> bool:
        """Complete this step's exchange with zeros and reset DDP's reducer (see the module
        docstring); False when that cannot be done."""
        reducer = getattr(model, "reducer", None)
        needed = ("_reset_state", "_get_zeros_like_grad_buckets")
        exchange = self._exchange_of(model)
        if exchange is None or reducer is None or not all(hasattr(reducer, n) for n in needed):
            return False
        buckets = reducer._get_zeros_like_grad_buckets()  # DDP's current layout, zero-filled
        if not exchange.abort_step(self._exchange_step, buckets):
            return False
        reducer._reset_state()
        exchange.take_void_step()  # this rank's own mark: it knows already
        return True

    def _void_step(self, model: Any) -> int | None:
        exchange = self._exchange_of(model)
        return exchange.take_void_step() if exchange is not None else None

    def _exchange_of(self, model: Any) -> Any:
        """The hook that carries `model`'s gradients: its own where trainspec hooked it
        (None for a model DDP's own all-reduce carries), else the one given, if that is one
        hook (a HookSet cannot abort one model's exchange). None: none to complete."""
        if is_hooked(model):
            return hook_of(model)
        return self.exchange if hasattr(self.exchange, "abort_step") else None

    def _run_once(self, micro: list[MicroBatch], forward: ForwardFn, model: Any, timer: Any) -> Any:
        self.last_split = micro
        total = None
        for k, mb in enumerate(micro):
            with _no_sync(model, not mb.last):
                self.where = (k, "forward")
                with _phase(timer, "forward"):
                    loss = forward(mb)
                self.where = (k, "backward")
                exchange = self._exchange_of(model) if mb.last else None
                if exchange is not None:
                    self._exchange_step = exchange.step  # the hook step this backward runs
                whole = mb.weight == 1.0  # the whole share at once: no extra ops, today's cost
                with _phase(timer, "backward"):
                    (loss if whole else loss * mb.weight).backward()
            part = loss.detach() if whole else loss.detach() * mb.weight
            total = part if total is None else total + part
            del loss
        return total

    def _reset(self, model: Any, *, broadcast_done: bool = True) -> None:
        """Void this step's gradients. `broadcast_done`: this rank alone runs the step again,
        and its failed attempt already made the step's buffer broadcast with the other
        ranks; False when every rank runs it again (each broadcasts again, alike)."""

        model.zero_grad(set_to_none=True)  # this step's partial accumulation is void
        if broadcast_done and hasattr(model, "require_forward_param_sync"):
            model.require_forward_param_sync = False  # buffers were broadcast this step
        _empty_cache()

    def _record_redo(self, step: int) -> None:
        if self.emit is None:
            return
        with contextlib.suppress(Exception):  # telemetry never takes the step down
            self.emit(
                "fault",
                "step_redone",
                f"step {step} run again: another rank ran out of memory in its last backward "
                "and voided the step's gradient exchange",
                severity="warning",
                evidence={"step": step, "ranks": [self.rank]},
            )

    def _record(self, step: int, n: int, index: int, phase: str, before: tuple[int, int]) -> None:
        if self.emit is None:
            return
        size, count = before
        after = (effective(self.plan.limit, n), accumulation_steps(n, self.plan.limit))
        with contextlib.suppress(Exception):  # telemetry never takes the step down
            self.emit(
                "fault",
                "oom",
                f"out of memory in micro-batch {index + 1}/{count} ({phase}, {size} samples) at "
                f"step {step}: step retried with the same samples at micro-batch {after[0]} "
                "on this rank; other ranks adopt it at the next window",
                severity="warning",
                evidence={"step": step, "phase": phase, "share": n, "ranks": [self.rank]},
                before={"micro_batch": size, "accumulation_steps": count},
                after={"micro_batch": after[0], "accumulation_steps": after[1]},
            )


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _distributed(model: Any) -> bool:
    return hasattr(model, "no_sync")


def _no_sync(model: Any, skip: bool) -> contextlib.AbstractContextManager[Any]:
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _phase(timer: Any, name: str) -> Iterator[None]:
    if timer is None:
        yield
        return
    with timer.phase(name):
        yield
