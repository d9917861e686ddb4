"""The step's gradient norm without a DDP hook (`runtime/auto.py`): read from each
optimizer's parameters at its step, as they were before the script's `clip_grad_norm_`
(reusing an L2 clip's own result where it is the step's norm)."""

from __future__ import annotations

from typing import Any

from trainspec.runtime.auto_session import AutoSessionLifecycle


class AutoGradientNorms(AutoSessionLifecycle):
    """The zero-code layer's gradient norm reads with no DDP model: at each optimizer step,
    and around the script's clips."""

    def _without_ddp(self, optimizer: Any) -> None:
        """No DDP model: read the gradient norm of each optimizer's parameters before it
        updates them (as they were before the script's clip, if it clipped)."""
        if optimizer is None or self.ddp_hooked:
            return
        source = self._optimizer_norm_source()
        if source is not None:
            source.capture(optimizer, before_clip=self._clipped, clips=self._clips)

    def _optimizer_norm_source(self) -> Any:
        """The session's `OptimizerGradientNorm` (made the first time), or None where the
        session takes its gradient statistics from elsewhere (a hook) or collects nothing."""
        session = self.session
        if session is None or session.collector is None:
            return None
        if session.grad_source is None:
            from trainspec.collector.gradients import OptimizerGradientNorm

            self._optimizer_norm = session.grad_source = OptimizerGradientNorm()
        return self._optimizer_norm if session.grad_source is self._optimizer_norm else None

    def after_clip(self, parameters: Any, total_norm: Any) -> None:
        """`clip_grad_norm_` (the L2 norm) has scaled `parameters`' gradients and returned
        their norm before it did: that is these parameters' share of the step's norm, and
        the optimizers' reads leave them out. The script's clip computed it already;
        computing it again was the same work twice (one norm per parameter, then their
        stack, on every step). Kept here until the step's optimizers read it, so a step end
        noticed late (at the next optimizer step) or a session that starts at the first
        optimizer step does not lose it."""
        if self.stood_down or self.ddp_hooked or not self._on_train_thread():
            return
        import torch

        from trainspec.collector.gradients import ClipRecord

        ids = frozenset(id(p) for p in parameters if p.grad is not None)
        if ids and isinstance(total_norm, torch.Tensor):  # a clip patched by someone else
            self._clips.append(ClipRecord(ids, total_norm))

    def clip_reusable(self, parameters: Any) -> bool:
        """Whether an L2 clip of `parameters` about to run returns their norm as the step
        has it, to be reused (`after_clip`). Not where an earlier clip of this step, of any
        norm, scaled one of their gradients (the result would be of clipped gradients), nor
        where an optimizer has read one of them since the step's last backward (they would
        count twice): those take `before_clip`, each parameter's norm read before the
        clip."""
        if self.stood_down or self.ddp_hooked or not self._on_train_thread():
            return False  # nothing is read here: the clip runs as it is
        ids = {id(p) for p in parameters}
        if any(not ids.isdisjoint(record.params) for record in self._clips):
            return False
        if not ids.isdisjoint(self._clipped):
            return False
        source = self._optimizer_norm
        return source is None or not source.has_read(ids)

    def before_clip(self, parameters: Any) -> None:
        """`clip_grad_norm_` is about to scale `parameters`' gradients: with no DDP hook,
        their norms now are the step's (read at the optimizer step, after the clip, the
        norm was the clip's bound on every step)."""
        if self.stood_down or self.ddp_hooked or not self._on_train_thread():
            return
        from trainspec.collector.gradients import gradient_norms

        for key, norm in gradient_norms(parameters).items():  # the first read is the raw norm
            self._clipped.setdefault(key, norm)
