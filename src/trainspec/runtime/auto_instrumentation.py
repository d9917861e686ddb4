"""`AutoInstrumentation`, the zero-code layer's step state machine (`runtime/auto.py`
patches torch to call it): batches read, forwards, backwards and optimizer steps, told apart
as training or evaluation, make the steps' phases, samples and boundaries."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from trainspec.runtime.auto_containment import contained
from trainspec.runtime.auto_gradient_norms import AutoGradientNorms
from trainspec.runtime.auto_session import _Provisional
from trainspec.runtime.batches import batch_size

log = logging.getLogger("trainspec.runtime")


class AutoInstrumentation(AutoGradientNorms):
    """The zero-code layer of one process: the patched points (`install`) call its `on_*`
    methods; its session's lifecycle and gradient norm reads are its bases'."""

    def stand_down(self) -> None:
        """The script starts trainspec itself (`trainspec.init`): from now on its own
        `step()` blocks are the steps, and these hooks do nothing. A step they opened is
        dropped unrecorded; the session, if they started one, is the script's."""
        if self.stood_down:
            return
        # a step whose optimizers all stepped is the layer's, and over (inside the script's
        # `trainspec.init`: whatever goes wrong here is not the script's)
        contained(self, self._finish_step)
        self._provisional = None
        for model in list(self._hook_pending):  # the script's `actuate` finds them hooked
            contained(self, self._attach_pending, model, True)
        self.explicit = True
        if self.session is not None and self.ctx is not None:
            self.session.discard_step(self.ctx)
        self.ctx = None
        log.info("trainspec: the script starts trainspec itself; its own steps are measured")

    def on_shadow_pass(self) -> None:
        """DDP's join: this rank's data ran out, and it shadows a step the other ranks train
        (`hook_wiring.watch_join`): the step it trained last is over, before that pass's
        figures reach the hook."""
        if self.stood_down or not self._on_train_thread():
            return
        self._resolve_as_evaluation()
        self._in_optimizer = None
        self._finish_step()

    # -- patched points --------------------------------------------------------------------

    def on_ddp_model(self, model: Any) -> None:
        """The script built a DDP model: the gradient hook goes on it at its first forward
        with gradients on (DDP takes one hook: a script that registers its own before then
        keeps it, `on_script_comm_hook`), and its forward is timed (the non-DDP phase
        bookkeeping stops)."""
        if self.stood_down:  # the script hooks its own model (`wrap`), or a forked child
            return
        from torch import compiler

        self.ddp_hooked = True
        if self.ctx is not None:
            self.ctx.timing.discard("forward")
        if self.session is not None and self.session.hooks_gradients:
            self._hook_pending.add(model)

        # Under torch.compile the hooks run inside the compiled region: Dynamo would trace
        # them, break its graph at their lock and clock, and guard on their state. Left
        # uncompiled, each is one clean break at the region's edge, run as plain Python.
        def forward_start(m: Any, a: Any, k: Any) -> None:
            if self._hook_pending:
                contained(self, self._attach_pending, m)
            contained(self, self.on_forward_start, (a, k), m.training)

        start = compiler.disable(forward_start)
        end = compiler.disable(lambda m, a, o: contained(self, self.on_forward_end))
        model.register_forward_pre_hook(start, with_kwargs=True)
        model.register_forward_hook(end)

    def _attach_pending(self, model: Any, now: bool = False) -> None:
        """`model`'s first forward with gradients on (every rank's, before its first
        backward; `now`: the script starts trainspec itself): trainspec's gradient hook
        goes on it, unless the script registered its own since it was built. Not at a
        forward under no_grad: an evaluation one rank runs alone before training would make
        the hook's process group (a collective) on that rank only."""
        if model not in self._hook_pending or not (now or torch_grad_enabled()):
            return
        self._hook_pending.discard(model)
        if self.session is None or self.forked:
            return
        self._registering = True
        try:
            self.session.grad_source = self.session.attach_hook(model)
        finally:
            self._registering = False

    def on_script_comm_hook(self, model: Any) -> None:
        """The script registers a communication hook of its own on `model` (a DDP model
        takes one): before trainspec's went on, trainspec's is off for that model, as for
        a model with sparse gradients (`hook_wiring.py`)."""
        if self._registering or model not in self._hook_pending:
            return
        from trainspec.runtime.hook_wiring import HOOKED

        self._hook_pending.discard(model)
        vars(model)[HOOKED] = None  # declined: a later `wrap` or `attach_hook` keeps theirs
        log.warning(
            "trainspec: the script registers its own communication hook: trainspec's "
            "gradient statistics and compression are off for this model"
        )

    def on_batch(self, batch: Any, waited: float, source: object = None) -> None:
        """`source` (a loader's iterator) gave `batch` after `waited` seconds."""
        if self.stood_down:
            return
        if not self._on_train_thread():  # a prefetch thread's read: not the loop's wait
            return
        self._resolve_as_evaluation()  # a batch came first: the last forward evaluated
        self._in_optimizer = None  # an optimizer step that raised never reached its post hook
        self._finish_step()  # the step before this batch is over
        if not torch_grad_enabled():  # an evaluation loop's batch, read under no_grad
            self._evaluation_seen()
            return
        self._step_read = True
        requested = time.time() - waited
        if self.session is None and self.alone:
            before = time.time()
            self.start(group_made=False)  # `trainspec run -- python`: its first batch
            requested += time.time() - before  # trainspec's own set-up is not the step's
        self._mark_first_step(requested)
        if self.ddp_hooked:  # a training forward tells whether this batch is trained on
            if self._first_request is None:
                self._first_request = requested
        else:
            self._training_starts(requested)
        self._batches.read(source, batch, waited)
        if not self.ddp_hooked:  # the batch counts at the backward that trains on it
            timing = self._timing()
            if timing is not None:
                timing.begin("forward")  # the step's work on this batch starts

    def on_loader_end(self, source: object) -> None:
        """`source` (a loader's iterator) is exhausted."""
        if not self.stood_down and self._on_train_thread():
            self._batches.ended(source)

    def _count_batches(self, inputs: Any = None, *, fed: bool | None = None) -> int:
        """The batches a training forward on `inputs` trains on are the step's samples, and
        the batches read since the last one took some are its data wait (a batch that only
        an evaluation's forward under no_grad took is neither; `runtime/batches.py`).
        `inputs`: the forward's, which tell the batch it trains on (a loop that reads one
        ahead), and counted for a batch of unknown size. Without a DDP model (no forward
        seen) a backward takes them: of each loader that the loop asked for one since, all
        but the newest batch waiting (a loop that reads one ahead trains on the older), all
        where one waits or the loader ended since (`runtime/batches.py`)."""
        samples, wait_s = self._batches.take(inputs, fed=self._step_read if fed is None else fed)
        self._step_samples += samples
        self._pending_wait += wait_s
        return samples

    def on_forward_start(self, inputs: Any = None, module_training: bool = True) -> None:
        if self.stood_down:
            return
        self._resolve_as_evaluation()  # a forward came first: the last one evaluated
        if self._in_optimizer is None and self._step_is_over():
            self._finish_step()
        if not torch_grad_enabled():  # an evaluation under no_grad
            self._evaluated(module_training)
            return
        if not module_training and self._in_optimizer is None:
            # `model.eval()` with gradients on: training only if a backward follows
            mark = None if self.ctx is None else self.ctx.timing.clock.mark()
            self._provisional = _Provisional(inputs, time.time(), self.ctx, mark)
            return
        self._training_forward(inputs, time.time())

    def _evaluated(self, module_training: bool) -> None:
        """An evaluation's forward: neither samples nor the step's forward time."""
        self._batches.evaluated()
        self._first_request = None  # the batches read for it were the evaluation's
        self._step_read = False
        if not module_training:  # `model.eval()`: not a no_grad pass inside training
            self._evaluation_seen()

    def _resolve_as_evaluation(self) -> None:
        """A forward, a batch read, came after a provisional forward (`_Provisional`) with
        no backward between: it was an evaluation, as one under no_grad is (a validation
        loop that leaves gradients on counted its batches, 208 samples for a step of 8,
        and its time, in the step it ran in: QA, 2026-11-27)."""
        if self._provisional is not None:
            self._provisional = None
            self._evaluated(False)

    def _resolve_as_training(self) -> None:
        """A backward (or an optimizer step) came after a provisional forward: it trained,
        with the model in `eval()` mode; it counts from where it began."""
        p, self._provisional = self._provisional, None
        if p is None:
            return
        same = p.ctx is not None and p.ctx is self.ctx
        self._training_forward(p.inputs, p.began, p.start if same else None)
        if same and p.end is not None and self._forward_open:  # as `on_forward_end`, then
            self._forward_open = False
            timing = self.ctx.timing
            timing.discard("forward")
            timing.marks.setdefault("forward", []).append((p.start, p.end))
            timing.begin("backward", at=p.end)
            self._forward_done = True

    def _training_forward(self, inputs: Any, now: float, start: Any = None) -> None:
        """A training forward on `inputs` began at `now` (wall time; `start`: at that mark
        of the step's clock, or now)."""
        self._mark_first_step(now)
        first, self._first_request = self._first_request, None
        self._training_starts(now if first is None else first)
        taken = self._count_batches(inputs) if self._batches.waiting() else 0
        if taken:
            self._step_took = True  # (a read-ahead loop's last step reads no batch)
        elif not self._step_read and not self._step_took:
            # No DataLoader batch: the forward's own input is its batch (a closure evaluated
            # again in one optimizer step runs on the same batch).
            again = self._in_optimizer is not None and self._step_samples > 0
            taken = 0 if again else batch_size(inputs)
            self._step_samples += taken
        if self.session is not None and taken:
            self.session.share_batch(taken)
        if self.ctx is None:
            return
        if self._in_optimizer is not None:  # a closure the optimizer evaluates (LBFGS)
            self.ctx.timing.end("optimizer")
            self.ctx.timing.begin("forward")
            self._forward_open = True
        elif not self._forward_done:
            self.ctx.timing.begin("forward", at=start)
            self._forward_open = True

    def _evaluation_seen(self) -> None:
        """An evaluation ran (a batch read under `no_grad`, or a forward of a model in
        `eval()` mode under it): if the open step has not trained yet, it starts when it
        does, not where the last step ended."""
        if not self._trained_in_step and self._steps_done > 0:
            self._evaluated_before_training = True

    def _training_starts(self, at: float) -> None:
        """A training batch was requested, or a training forward began, at `at` (wall time).
        The step's first: if an evaluation (forwards under no_grad) ran since the last step
        ended, the step starts here, not at that end: a validation pass between epochs made
        the next step's time its own (1.0 s against a 4 ms median) and its throughput 250x
        too low. Its time is no step's, as a script's set-up is none."""
        if self._trained_in_step:
            return
        self._trained_in_step = True
        if self._evaluated_before_training and self.ctx is not None:
            self.ctx.wall_start = at  # (without DDP, the batch read re-begins the forward)
        self._evaluated_before_training = False

    def _step_is_over(self) -> bool:
        """At a training forward or backward call: whether what has stepped so far ends the
        step. Once the script's optimizers are known, when every one of them has stepped.
        The first step's are not known yet: where it trained on a DataLoader batch its next
        batch ends it (a GAN steps D, then runs G's forward and steps G, all in one training
        step, which ended at G's forward and shifted every later step by half an
        iteration); without one, the next forward or backward does."""
        if self._steps_done == 0:
            return not (self._step_read or self._step_took)
        return self._stepped >= self._optimizers

    def on_forward_end(self) -> None:
        if self.stood_down:
            return
        p = self._provisional
        if p is not None:  # told apart at what comes next
            if p.end is None and p.ctx is not None:
                p.end = p.ctx.timing.clock.mark()
            return
        if self.ctx is not None and self._forward_open:
            self._forward_open = False
            self.ctx.timing.end("forward")
            self.ctx.timing.begin("backward")
            self._forward_done = True

    def on_optimizer_pre(self, optimizer: Any = None) -> None:
        if self.stood_down:
            return
        self._resolve_as_training()  # (no backward seen: `torch.autograd.grad`)
        self._train_thread = threading.get_ident()
        if id(optimizer) in self._stepped:  # it stepped in this step already: a new step
            self._finish_step()
        if self.session is None and not self.group_only:
            self.start(group_made=False)
        if not self.ddp_hooked and not self._step_took:
            self._take_without_ddp()  # no backward seen (`torch.autograd.grad`)
        self._without_ddp(optimizer)
        if self.ctx is not None:
            if not self.ddp_hooked:  # after the last backward: not the step's forward
                self.ctx.timing.discard("forward")
            if self.ctx.backward_end is None:  # the step's first optimizer ends its backward
                self.ctx.timing.end("backward")
                self.ctx.backward_end = time.perf_counter()
            self.ctx.timing.begin("optimizer")
        self._in_optimizer = id(optimizer)

    def _take_without_ddp(self) -> None:
        """No DDP model: a backward takes the batches it trains on (of each loader the loop
        asked for one since, all waiting but the newest, read ahead; all where one waits or
        the loader ended since), or, where the step's optimizer steps with no backward seen
        (`torch.autograd.grad`), the optimizer does. Batches counted as read gave a loop
        that reads one ahead [8, 2, 0] for an epoch of [4, 4, 2]; the oldest batch alone, a
        loop that reads 4 for one backward 8 a step for 32. A k-batch loop counts k - 1 in a
        loader's first step (`runtime/batches.py`). (No forward under no_grad is seen: a
        stale batch is one a loader's end left, a read-ahead loop's last.)"""
        if self._batches.waiting() and self._count_batches(fed=True):
            self._step_took = True

    def on_optimizer_post(self, optimizer: Any = None) -> None:
        """An optimizer stepped; the step ends here. Once every optimizer the script has
        stepped so far has stepped in this step, the step is over, and it is closed at what
        comes next: the next batch, forward or backward, or an optimizer of this step
        stepping again. An optimizer that was not known steps in the step that runs (a
        second optimizer stepped every other batch, or one unfrozen mid-run, made a step of
        its own, with no samples and only its optimizer phase). The first step, whose
        optimizers are not known yet, is closed at the next batch or forward, or when one
        of them steps again: a script with two optimizers (a GAN, a model and its head)
        steps both in one training step, which counted as two."""
        self._in_optimizer = None
        if self.ctx is None or self.session is None or self.stood_down:
            return
        self.optimizer_steps += 1
        self.ctx.timing.end("optimizer")
        self._stepped.add(id(optimizer))
        self._optimizers.add(id(optimizer))
        self._stepped_at = time.time()
        if not self.ddp_hooked:  # where the next step's tentative forward begins
            self._post_mark = self.ctx.timing.clock.mark()

    def on_optimizer_skipped(self, optimizer: Any) -> None:
        """A GradScaler found inf or NaN gradients and did not step `optimizer`: the
        training step is over all the same (every rank skips it: the gradients were
        all-reduced), and the skip is an event."""
        if self.stood_down:
            return
        self.on_optimizer_pre(optimizer)
        if self.session is not None:
            self.session.event(
                "anomaly", "optimizer_step_skipped",
                "the gradient scaler found inf or NaN gradients: the optimizer did not step",
                evidence={"optimizer": type(optimizer).__name__},
            )  # fmt: skip
        self.on_optimizer_post(optimizer)

    def on_backward_start(self) -> None:
        """`loss.backward()` begins: with no DDP model, the step's forward ends here; with
        one, a forward of its model in `eval()` mode since was training."""
        if self.stood_down or not self._on_train_thread():
            return
        self._resolve_as_training()
        if self.ddp_hooked:
            return
        if self.session is None and self.alone:
            self.start(group_made=False)  # `trainspec run -- python`, with no DataLoader
        timing = self._timing()
        if not self._first_marked and timing is not None and self._steps_done == 0:
            # No batch marked where step 0 began: it begins here, its forward unseen (from
            # the session's start it held the script's whole set-up).
            self._mark_first_step(time.time())
            timing.begin("forward")  # re-begun now: about 0, not the set-up
        if self._in_optimizer is None and self._step_is_over():
            self._finish_step()  # a loop without a DataLoader: the previous step is over
            timing = self._timing()
        self._take_without_ddp()
        self._clipped, self._clips = {}, []  # gradients anew: a clip before this is not theirs
        if self._optimizer_norm is not None:  # ... nor a read before this
            self._optimizer_norm.new_gradients()
        if timing is not None:
            # A closure's backward inside the optimizer's step (its forward, with no module
            # hook to see it, stays in the optimizer phase).
            timing.end("optimizer" if self._in_optimizer is not None else "forward")
            timing.begin("backward")

    def on_backward_end(self) -> None:
        if self.stood_down or not self._on_train_thread():
            return
        if self.ddp_hooked and self._in_optimizer is None:
            return  # DDP: backward runs from the forward's end to the optimizer's step
        timing = self._timing()
        if timing is None:
            return
        timing.end("backward")
        if self._in_optimizer is not None:  # a closure's backward: the optimizer goes on
            timing.begin("optimizer")
        else:
            timing.begin("forward")  # tentative: the next micro-batch, if one comes


def torch_grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()
