"""Step phases from what `Session.wrap` knows, for a step whose body marks none.

A `with ts.step(...)` body without `s.phase(...)` blocks stored no forward, backward or
optimizer time, and the catalogue requires all three: the run failed `trainspec validate`.
The wrapped model's forward hooks and the optimizer's step hooks mark them instead, on the
step's own phase clock (CUDA events on a GPU), as the zero-code mode does for a DDP model:
- forward: the model's forward, pre-hook to hook; the forwards of a step add up;
- backward: from a forward's end to the next training forward (gradient accumulation) or
  to the optimizer step's pre-hook;
- optimizer: the optimizer step's pre-hook to its post-hook. With no optimizer given to
  `wrap`, torch's global optimizer step hooks stand in, for this session only: they act
  while one of its steps is open, also read the single-process gradient norm there, and
  are removed when the session closes.

The marks are kept apart from the step's timing and handed to it only at the step's end,
and only if nothing marked it (`settle`): a step that marks any phase keeps exactly its
own marks, and the zero-code layer, which marks the step's timing itself, is never doubled.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainspec.runtime.step_timer import StepTiming

log = logging.getLogger("trainspec.runtime")


def marked(timing: StepTiming) -> bool:
    """Whether anyone marked `timing`: the script's `phase()` blocks or the zero-code layer."""
    return timing.touched()


class PhaseHooks:
    """One session's automatic phase marks: hooks on the models and optimizers it wrapped."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._ctx: Any = None  # the step that `_auto` belongs to
        self._auto: StepTiming | None = None
        self._backward_end: float | None = None  # perf_counter at the step's last backward end
        self._handles: list[Any] = []
        self._models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._global = False
        self._updates: list[tuple[frozenset[int], Callable[[], None]]] = []
        self._failed = False
        self._unscale_hook: Callable[[], None] | None = None  # loss_scale.before_unscale's remover

    # -- what is watched -------------------------------------------------------------------
    def watch_model(self, model: Any) -> None:
        if model in self._models:
            return
        self._models.add(model)
        try:
            start = model.register_forward_pre_hook(_ForwardStart(self))
        except RuntimeError as exc:  # a TorchScript module takes no hook: wrap it all the same
            log.warning(
                "trainspec: no forward or backward phase from %s: %s", type(model).__name__, exc
            )
            return
        self._handles.append(start)
        self._handles.append(model.register_forward_hook(_ForwardEnd(self)))
        self._watch_unscaling()

    def _watch_unscaling(self) -> None:
        """End the step's open automatic backward as a GradScaler unscales (a micro-step's
        gradients must be observed while they still carry the loss scale)."""
        if self._unscale_hook is None:
            from trainspec.runtime import loss_scale

            loss_scale.install()
            self._unscale_hook = loss_scale.before_unscale(lambda: self._contained(self.on_unscale))

    def watch_optimizer(self, optimizer: Any) -> None:
        if optimizer in self._optimizers:
            return
        self._optimizers.add(optimizer)
        self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre))
        self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))

    def watch_all_optimizers(self) -> None:
        """Every optimizer's step, through torch's global hooks (wrap got no optimizer)."""
        if self._global:
            return
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._global = True
        self._handles.append(register_optimizer_step_pre_hook(self._global_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))

    def before_update(self, parameters: Iterable[Any], update: Callable[[], None]) -> None:
        """Call `update` (a gradient norm's read) at the global pre-hook of each optimizer
        that steps any of `parameters` in an open step: another model's optimizer, stepped
        after this one zeroed its gradients, would overwrite the norm with 0."""
        self._updates.append((frozenset(id(p) for p in parameters), update))

    def remove(self) -> None:
        """Take every hook off (the session closes); a model that outlives it runs bare."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._unscale_hook is not None:
            self._unscale_hook()
            self._unscale_hook = None
        self._models, self._optimizers = weakref.WeakSet(), weakref.WeakSet()
        self._global = False
        self._updates.clear()
        self._ctx = self._auto = None

    # -- the step's end --------------------------------------------------------------------
    def settle(self, ctx: Any) -> None:
        """`ctx` ends: it takes the automatic marks if nothing marked its own timing."""
        if ctx is not self._ctx or self._auto is None:
            return
        auto, backward_end = self._auto, self._backward_end
        self._ctx = self._auto = None
        if auto.marks and not marked(ctx.timing):
            ctx.timing = auto
            if ctx.backward_end is None:
                ctx.backward_end = backward_end

    # -- the hooks' bodies -----------------------------------------------------------------
    def _timing(self) -> StepTiming | None:
        """The open step's automatic marks; None when there is nothing of ours to time: no
        step open (an evaluation between steps) or a step whose own timing is marked."""
        session = self._session
        ctx = session.open_step
        if ctx is None or marked(ctx.timing):
            return None
        if ctx is not self._ctx:
            self._ctx, self._auto, self._backward_end = ctx, StepTiming(ctx.timing.clock), None
        return self._auto

    def on_forward_start(self) -> None:
        if not torch.is_grad_enabled():  # an evaluation under no_grad: not the step's forward
            return
        auto = self._timing()
        if auto is not None:
            self._end_backward(auto)  # the previous micro-batch's backward ends here
            auto.begin("forward")

    def on_forward_end(self) -> None:
        auto = self._timing()
        if auto is not None and auto.is_open("forward"):
            auto.end("forward")
            auto.begin("backward")

    def on_optimizer_pre(self) -> None:
        auto = self._timing()
        # Open already: one step seen by its optimizer's own hook and by the global one.
        if auto is not None and not auto.is_open("optimizer"):
            self._end_backward(auto)
            auto.begin("optimizer")

    def on_unscale(self) -> None:
        auto = self._timing()
        if auto is not None:
            self._end_backward(auto)

    def on_optimizer_post(self) -> None:
        auto = self._timing()
        if auto is not None:
            auto.end("optimizer")

    def _end_backward(self, auto: StepTiming) -> None:
        if not auto.is_open("backward"):
            return
        auto.end("backward")
        self._backward_end = time.perf_counter()
        after = getattr(self._session.grad_source, "after_backward", None)
        if after is not None:  # micro-step statistics, as a `phase("backward")` block gives;
            self._contained(after)  # a failure of theirs costs the statistics, not the phases

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._contained(self.on_optimizer_pre)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._contained(self.on_optimizer_post)

    def _global_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session.open_step is None:  # outside this session's steps: not ours
            return
        self._contained(self.on_optimizer_pre)
        for params, update in self._updates:
            if _steps_any(optimizer, params):
                self._contained(update)

    def _contained(self, body: Callable[[], None]) -> None:
        """Run a hook's body; what it raises is trainspec's failure, never the script's."""
        try:
            body()
        except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
            if not self._failed:
                self._failed = True
                log.warning(
                    "trainspec: automatic step phases failed: %s: %s", type(exc).__name__, exc
                )


def _steps_any(optimizer: Any, params: frozenset[int]) -> bool:
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])


class _ModelHook:
    """A forward hook of a wrapped model. A model saved whole (`torch.save(model)`) pickles
    its hooks, and the session cannot be pickled: saved, it is an inert hook."""

    def __init__(self, hooks: PhaseHooks) -> None:
        self._hooks = hooks

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_InertHook, ())


class _ForwardStart(_ModelHook):
    # Under torch.compile, Dynamo would trace the body (breaking the user's graph at our
    # clock and guarding on our state); disabled, it is one clean break at the region's
    # edge, run as plain Python (as the zero-code mode's DDP hooks are).
    @torch.compiler.disable
    def __call__(self, module: Any, args: Any) -> None:
        self._hooks._contained(self._hooks.on_forward_start)


class _ForwardEnd(_ModelHook):
    @torch.compiler.disable
    def __call__(self, module: Any, args: Any, output: Any) -> None:
        self._hooks._contained(self._hooks.on_forward_end)


class _InertHook:
    """What a saved model's phase hook loads as: a hook that does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


def watch_phases(session: Any, model: Any, optimizer: Any) -> PhaseHooks:
    """The session's phase hooks, now also on `model` and on `optimizer` (every optimizer,
    through the global hooks, when it is None)."""
    hooks = session.phase_hooks
    if hooks is None:
        hooks = session.phase_hooks = PhaseHooks(session)
    hooks.watch_model(model)
    if optimizer is not None:
        hooks.watch_optimizer(optimizer)
    else:
        hooks.watch_all_optimizers()
    return hooks
