"""Wiring the actuator into a session: the share sampler, fault injection and the controller.

`session.actuate(...)` (this module's `attach`) returns an `Actuation`, the training loop's
handle: `sampler` (a `ShareBatchSampler` the controller may rebalance), `injector` (faults
from `TRAINSPEC_INJECT`), `micro_batch` (the rank's `MicroBatchPlan`, which the memory policy
and OOM retries move), `accumulate(...)` (run the step's share as micro-batches), and
`controller`, or None when the actuator is off (`TRAINSPEC_ACTUATOR=off`,
`actuator.enabled = false`), the job is not distributed, or the gradient hook is absent
(collector off). The controller runs at the session's step boundary.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainspec.actuator import FLAG_PREEMPT, Controller, Targets
from trainspec.actuator.actions import CheckpointCallback
from trainspec.actuator.checkpointing import PENDING
from trainspec.actuator.memory import memory_capacity, read_memory
from trainspec.actuator.micro_batch import MicroBatchPlan
from trainspec.config import kill_switch_on
from trainspec.data import ShareBatchSampler, StepBatch
from trainspec.runtime import arguments
from trainspec.runtime.accumulate import ForwardFn, MicroBatchRunner
from trainspec.runtime.hardware_health import attach_hardware_health
from trainspec.runtime.inject import Injector
from trainspec.runtime.probe_latency import probe_window
from trainspec.runtime.young_daly import interval_steps

if TYPE_CHECKING:
    from trainspec.runtime.actuator_state import ActuatorState

log = logging.getLogger("trainspec.actuator")


@dataclass
class Actuation:
    sampler: ShareBatchSampler
    injector: Injector
    controller: Controller | None
    rank: int
    checkpointer: Any = None  # runtime.checkpoint.Checkpointer when a directory was given
    save_checkpoint: Any = None  # (step, reason) -> seconds, when a directory was given
    # With operator actions on: saves asked for at a boundary, made after its last hook
    # (runtime/checkpoint_boundary.py), so the controller's and the operator's changes at
    # one boundary are both in the checkpoint.
    boundary_save: Any = None
    preemption: Any = None  # runtime.heartbeat.PreemptionWatcher when a directory was given
    session: Any = None
    operator: Any = None  # runtime.operator_actions.OperatorActions when an agent is configured
    micro_batch: MicroBatchPlan = field(default_factory=MicroBatchPlan)
    runner: MicroBatchRunner | None = None
    model: Any = None  # what the built-in checkpointer saves and `resume` loads
    optimizer: Any = None
    state: ActuatorState | None = None  # what the built-in checkpointer saves of the actuator
    _oom_hooked: bool = False
    _step: int = 0
    _closed: bool = False

    def resume(self) -> int:
        """Load the newest committed checkpoint under the checkpoint directory into the
        model, the optimizer and the sampler (its position and shares, so no sample is used
        twice or skipped), put the actuator's own state back (compression level, micro-batch
        limit, error feedback, the controller's hysteresis: runtime/actuator_state.py), and
        continue the session's step count from it. Every rank calls this at the same point,
        before its loop; the step to start the loop at (0: a fresh start).
        Raises CheckpointError when checkpoints exist but none loads, were written by
        another world size, or hold a malformed actuator state: training must not go on
        from a wrong state."""
        if self.checkpointer is None:
            return 0
        loaded = self.checkpointer.load_latest(
            model=self.model, optimizer=self.optimizer, sampler=self.sampler
        )
        if loaded is None:
            return 0
        restored: dict[str, Any] = {}
        if self.state is not None:  # collective: every rank restores alike, or raises alike
            restored = self.state.restore(loaded.trainspec_state, Path(loaded.path))
        if self.session is not None:
            self.session.step_index = loaded.step
            self.session.event(
                "checkpoint", "resumed", f"resumed from the checkpoint of step {loaded.step}",
                evidence={"path": loaded.path, "step": loaded.step, "load_s": loaded.load_s,
                          "fallbacks": loaded.fallbacks, "actuator": restored},
            )  # fmt: skip
        return loaded.step

    def accumulate(
        self, step: int, batch: StepBatch, forward: ForwardFn, *, model: Any, timer: Any = None
    ) -> Any:
        """Forward and backward over this rank's share as micro-batches; returns its mean loss.

        `forward(mb)` returns the mean loss over positions mb.start:mb.stop of the share
        (one placeholder sample with weight 0 for an empty share: the 0 returned then is no
        loss, and the controller leaves the step's reported loss out of its window; report
        none for it, `s.loss = None`); `model` is the DDP model (its `no_sync()` skips the
        all-reduce of all but the last micro-batch); `timer` (the `ts.step()` context) times
        each forward and backward. An OOM in a micro-batch is retried with a smaller one when
        that is safe; otherwise StepOutOfMemoryError.
        """
        if self.runner is None:  # built by hand, not by attach: no retry, no events
            self.runner = MicroBatchRunner(self.micro_batch, rank=self.rank, retry=False)
        runner = self.runner
        if not self._oom_hooked:
            self._hook_oom_faults(model)
        self._step = step
        if not batch.indices and timer is not None:  # inside the session's step: its index
            self._no_loss_at_this_step()
        return runner.run(step, len(batch.indices), forward, model=model, timer=timer)

    def _no_loss_at_this_step(self) -> None:
        if self.controller is not None and self.session is not None:
            self.controller.no_loss_at(self.session.step_index)

    def _hook_oom_faults(self, model: Any) -> None:
        """An injected OOM is raised where a real allocation failure surfaces: `oom` inside the
        model's forward, where DDP's own pre-forward has already run; `oom_backward` in the
        backward, when the gradient of the model's first parameter (an input-side one, so
        reached late, after DDP has handed some buckets to the hook) is computed."""
        self._oom_hooked = True
        kinds = {f.kind for f in self.injector.faults}
        inner = getattr(model, "module", model)
        runner = self.runner
        assert runner is not None

        def size() -> int:
            return runner.last_split[runner.where[0]].size

        if "oom" in kinds:
            inner.register_forward_pre_hook(
                lambda _m, _a: self.injector.check_micro_batch(self._step, size())
            )
        if "oom_backward" in kinds:
            first = next(inner.parameters())

            def in_backward(grad: Any) -> Any:
                self.injector.check_micro_batch(self._step, size(), kind="oom_backward")
                return grad

            first.register_hook(in_backward)

    def should_stop(self, step: int) -> bool:
        """At a step boundary, on every rank alike: True when any rank got SIGTERM. Then a
        checkpoint is saved (and waited for) first, so the preempted job resumes from here,
        and the exit deadline is disarmed: the loop is alive, and what the script does after
        it (an evaluation, saving the model) is its own. A step already saved at this
        boundary (the controller's or an operator's checkpoint) is not saved again: the
        in-flight save is waited for instead (a second write into the committed directory
        destroyed it when the process died part-way)."""
        if self.preemption is None or not self.preemption.should_stop():
            return False
        self.preempted()
        again, why, ckpt = False, "preemption: SIGTERM received", self.checkpointer
        if self.save_checkpoint is None:
            pass
        elif ckpt is not None:  # the built-in Checkpointer: one save per step by itself
            started = ckpt.saves_started
            self.save_checkpoint(step, why)
            ckpt.wait()
            again = ckpt.saves_started == started
        elif self.boundary_save is not None:  # a script's callback, its boundary saves known
            again = self.boundary_save.saved(step)
            self.boundary_save.save_now(step, why)
        else:  # a script's callback saves by itself
            self.save_checkpoint(step, why)
        self.preemption.disarm()
        if self.session is not None:
            reason = "preemption notice: checkpoint, then stop"
            if again:
                reason = f"preemption notice: step {step} is already checkpointed; stop"
            self.session.event(
                "action",
                "checkpoint",
                reason,
                severity="warning",
                evidence={"step": step, "already_saved": again},
            )
        return True

    def close(self) -> None:
        """Wait for an in-flight checkpoint and control gather (every rank calls this at the
        same point). The controller and operator actions leave the step boundary, SIGTERM goes
        back to its previous handler, and a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.session is not None:
            hooks = [
                getattr(part, "on_boundary", None) for part in (self.controller, self.operator)
            ]
            hooks.append(getattr(self.boundary_save, "flush", None))
            for hook in hooks:
                if hook is not None and hook in self.session.boundary_hooks:
                    self.session.boundary_hooks.remove(hook)
        for part in (self.controller, self.operator, self.checkpointer, self.preemption):
            if part is None:
                continue
            try:  # each part closes whatever another's close raised
                part.close()
            except Exception as exc:  # e.g. the script destroyed the default group first
                log.warning("trainspec: closing %s failed: %s", type(part).__name__, exc)

    def use_batch(self, batch: StepBatch, hook: Any) -> None:
        """Tell the gradient hook this step's true shares (the epoch's last step is short)."""
        if hook is not None:
            hook.set_shares(len(batch.indices), batch.global_count)

    def preempted(self) -> None:
        if self.controller is not None:
            self.controller.raise_flag(FLAG_PREEMPT)


def attach(
    session: Any,
    *,
    dataset_len: int,
    global_batch: int,
    seed: int = 0,
    device: Any = None,
    checkpoint_dir: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    checkpoint: CheckpointCallback | None = None,
    micro_batch: int | None = None,
) -> Actuation:
    """Build the sampler, injector and micro-batch plan, and the controller when the actuator
    is on.

    Checkpoints the controller decides go through `checkpoint(step, reason)` if given, else
    through a `Checkpointer` on `checkpoint_dir` saving `model`, `optimizer` (one, or a list
    or tuple of optimizers over disjoint parameters) and the sampler.
    `micro_batch` (samples; 0: the whole share) overrides `actuator.micro_batch`.
    Raises InjectSpecError / InjectionNotAllowedError for a bad TRAINSPEC_INJECT, ValueError
    naming the field for a bad micro-batch setting, TypeError for an `optimizer` that is
    neither an optimizer nor a list or tuple of them.
    """
    if optimizer is not None:
        optimizer = _optimizer_argument(optimizer)
    ident = session.identity
    sampler = ShareBatchSampler(
        dataset_len, global_batch, rank=ident.rank, world_size=ident.world_size, seed=seed
    )
    injector = Injector.from_env(rank=ident.rank)
    cfg = session.config.actuator
    micro_batch = arguments.optional_count("micro_batch", micro_batch)
    plan = MicroBatchPlan(
        cfg.micro_batch if micro_batch is None else micro_batch, cfg.min_micro_batch
    )
    # Agreed at init: off on any rank (its kill switch, actuator.enabled) is off on every one.
    switched_off = kill_switch_on() or not cfg.enabled
    runner = MicroBatchRunner(
        plan, rank=ident.rank, emit=session.event, retry=not switched_off, exchange=session.hook
    )
    if session.hook is not None:  # the sampler's shares, not the session's equal split
        session.manage_shares()
        session.hook.set_shares(sampler.shares[ident.rank], global_batch)
    if checkpoint is not None and not callable(checkpoint):
        raise TypeError(f"checkpoint must be a callable (step, reason), not {checkpoint!r}")
    configured = session.config.checkpoint.dir
    if not checkpoint_dir and configured:
        if checkpoint is None and (model is None or optimizer is None):
            log.warning("trainspec: checkpoint.dir %s unused: actuate() was given no model= "
                        "and optimizer= to save", configured)  # fmt: skip
        else:
            checkpoint_dir = configured
    if checkpoint_dir and session.groups is None and ident.world_size > 1:
        log.warning("trainspec: checkpoint_dir %s unused: these ranks formed no process group "
                    "to checkpoint together", checkpoint_dir)  # fmt: skip
        checkpoint_dir = None
    ckpt = state = None
    if checkpoint is None and checkpoint_dir:
        keep_last = session.config.checkpoint.keep_last
        from trainspec.runtime.actuator_state import ActuatorState

        state = ActuatorState.for_session(session, plan, model, sampler=sampler)
        ckpt, checkpoint = _checkpoint_callback(
            checkpoint_dir, model, optimizer, sampler, keep_last, session.event, state
        )
    boundary_save = None
    if checkpoint is not None and session.operator_actions:  # two hooks that change the plan
        from trainspec.runtime.checkpoint_boundary import BoundarySaves

        boundary_save = BoundarySaves(checkpoint, session.event)
    controller = _controller(
        session, sampler, global_batch, boundary_save or checkpoint, device, plan, injector
    )
    if state is not None:
        state.controller = controller
    preemption = None
    if checkpoint_dir:
        from trainspec.runtime.heartbeat import PreemptionWatcher

        preemption = PreemptionWatcher()  # installed after init: SIGTERM stops at a boundary
    actuation = Actuation(
        sampler, injector, controller, ident.rank, checkpointer=ckpt,
        save_checkpoint=checkpoint if checkpoint_dir else None, preemption=preemption, session=session,
        micro_batch=plan, runner=runner, model=model, optimizer=optimizer, state=state,
        boundary_save=boundary_save,
    )  # fmt: skip
    from trainspec.runtime.operator_actions import attach_operator_actions

    actuation.operator = attach_operator_actions(session, actuation)
    if boundary_save is not None:  # after the controller's and the operator's hooks
        session.boundary_hooks.append(boundary_save.flush)
    return actuation


def _checkpoint_callback(
    root: str,
    model: Any,
    optimizer: Any,
    sampler: ShareBatchSampler,
    keep_last: int,
    event: Callable[..., None],
    state: ActuatorState | None = None,
) -> tuple[Any, CheckpointCallback]:
    from trainspec.runtime.checkpoint import Checkpointer

    if model is None or optimizer is None:
        raise ValueError("checkpoint_dir (or checkpoint.dir) needs model= and optimizer= to save")

    def on_event(kind: str, reason: str, evidence: dict) -> None:
        # Each save's outcome and each load or fallback, stored (the Checkpointer names a
        # committed save by the label it was given).
        if reason in ("save_failed", "fallback", "loaded"):
            name, text = reason, f"checkpoint {reason.replace('_', ' ')}"
        else:
            name, text = "saved", f"checkpoint of step {evidence.get('step')} committed ({reason})"
        severity = "error" if name in ("save_failed", "fallback") else "info"
        event(kind, name, text, severity=severity, evidence=evidence)

    ckpt = Checkpointer(root, keep_last=keep_last, timeout_s=60, on_event=on_event)

    def save(step: int, reason: str) -> float | None:
        # The actuator's state as of this boundary: the plan the next step runs under.
        own, tensors = state.snapshot() if state is not None else (None, {})
        # The loss anomaly in progress, as the checkpoint policy sees it: retention keeps
        # the newest checkpoint taken before it began (runtime/checkpoint_layout.py).
        policy = getattr(getattr(state, "controller", None), "checkpointing", None)
        # The reason in words goes to the event; the checkpoint's own label stays short.
        ckpt.save(
            step,
            model=model,
            optimizer=optimizer,
            sampler=sampler,
            trainspec_state=own,
            rank_tensors=tensors,
            reason=reason.split(":")[0][:40],
            anomaly=getattr(policy, "anomaly", None),
        )
        last = ckpt.last_saved  # an async save in flight: the one before it, or None
        return last.duration_s if last is not None else None

    save.checkpointer = ckpt  # type: ignore[attr-defined]  # read by _checkpoint_cost
    return ckpt, save


def _optimizer_argument(optimizer: Any) -> Any:
    """`optimizer=` as the Checkpointer takes it: one optimizer, or a non-empty tuple of them
    (a list is accepted); TypeError naming the argument for anything else, up front (a list
    was once accepted here and then failed every checkpoint)."""

    def one(o: Any) -> bool:  # an Optimizer, or a wrapper that quacks like one
        return callable(getattr(o, "state_dict", None)) and hasattr(o, "param_groups")

    if isinstance(optimizer, (list, tuple)):
        if optimizer and all(one(o) for o in optimizer):
            return tuple(optimizer)
    elif one(optimizer):
        return optimizer
    raise TypeError(
        "optimizer= must be a torch.optim.Optimizer or a non-empty list or tuple of them, "
        f"not {type(optimizer).__name__}"
    )


def _checkpoint_cost(checkpoint: Any) -> Callable[[], float | None] | None:
    """The cost of the latest completed save, read when the actuator summarises a window:
    an async save completes after the action that started it returned, and the first one
    left the policy with no cost, so no Young/Daly checkpoint ever followed it. Before any
    save completed: `PENDING` while one is in flight (late, not failed: the policy waits
    for it), NaN otherwise (none made, or every one failed: the policy retries); never None,
    which `Targets` would read as "no news" and keep a stale PENDING. A script's own
    callback, deferred to the boundary's end, reports the cost it returned last."""
    saver = getattr(checkpoint, "checkpointer", None)
    if saver is None:
        from trainspec.runtime.checkpoint_boundary import BoundarySaves

        if isinstance(checkpoint, BoundarySaves):  # a script's callback, its saves deferred
            return lambda: checkpoint.last_cost
        return None

    def cost() -> float | None:
        last = saver.last_saved
        if last is not None:
            return float(last.duration_s)
        return PENDING if saver.in_flight else math.nan

    return cost


def _controller(
    session: Any,
    sampler: ShareBatchSampler,
    global_batch: int,
    checkpoint: CheckpointCallback | None,
    device: Any,
    plan: MicroBatchPlan,
    injector: Injector,
) -> Controller | None:
    cfg = session.config.actuator
    why_off = (
        f"TRAINSPEC_ACTUATOR={os.environ.get('TRAINSPEC_ACTUATOR', '')}" if kill_switch_on()
        else "actuator.enabled is false (here, or on a rank, settled at init)" if not cfg.enabled
        else "not distributed" if session.groups is None
        else "no gradient hook (collector off)" if session.hook is None
        else None
    )  # fmt: skip
    if why_off is not None:
        log.info("trainspec actuator off: %s", why_off)
        return None
    ident = session.identity
    per_gpu_mtbf_s = session.config.checkpoint.mtbf_gpu_hours * 3600.0

    def interval(cost_s: float, step_s: float) -> int:
        return interval_steps(cost_s, step_s, per_gpu_mtbf_s, ident.world_size)

    targets = Targets(
        rank=ident.rank,
        global_batch=global_batch,
        sampler=sampler,
        hook=session.hook,
        checkpoint=checkpoint,
        micro_batch=plan,
        checkpoint_cost_source=_checkpoint_cost(checkpoint),
    )
    latency = probe_window(session, injector)
    controller = Controller(
        cfg,
        world_size=ident.world_size,
        group=session.groups.control,
        targets=targets,
        emit=session.event,
        memory_probe=_memory_probe(device, injector, session),
        latency_probe=latency.take if latency is not None else lambda: math.nan,
        checkpoint_interval=interval,
        int8_block=session.config.kernels.int8_block_size,
    )
    if latency is not None:  # tapped only once the controller that empties it exists
        session.collector.add_tap(latency.observe)
    attach_hardware_health(session, controller, injector)  # its flags go into this window
    session.record_listeners.append(controller.on_record)
    session.boundary_hooks.append(controller.on_boundary)
    return controller


def _memory_probe(
    device: Any, injector: Injector, session: Any
) -> Callable[[], tuple[float, float]]:
    """(pressure, allocator retries) at a window boundary, with any injected squeeze on top."""
    capacity: list[float] = []  # measured once, on the first squeeze with bytes=

    def probe() -> tuple[float, float]:
        pressure, retries = read_memory(device)
        pressure = pressure if math.isfinite(pressure) else 0.0
        squeezes = injector.active("squeeze", session.step_index - 1)
        if squeezes:
            if not capacity and any(f.bytes is not None for f in squeezes):
                capacity.append(memory_capacity(device))
            total = capacity[0] if capacity else 0.0
            pressure = injector.squeezed_pressure(session.step_index - 1, pressure, total)
        return pressure, retries

    return probe
