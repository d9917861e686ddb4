"""Zero-code instrumentation: what `trainspec run -- torchrun ... script.py` injects.

Like `opentelemetry-instrument` for services, it patches the libraries the script already
uses rather than the script:
- `torch.distributed.init_process_group`: trainspec starts right after it (same program point
  on every rank, so the side groups can be created). A torchrun worker that makes no group
  starts at its first optimizer step; a process no launcher started (`trainspec run --
  python train.py`) at its first training batch or backward. A multiprocessing worker
  (`torch.multiprocessing.spawn`) starts only at its group, its rank and world size the
  group's; the script that spawns it trains nothing and is never measured.
- `DistributedDataParallel.__init__`: times forward, and registers trainspec's gradient hook
  at the model's first forward with gradients on; `register_comm_hook` (and its built-in
  variant): a script that registers its own hook before then keeps it, and trainspec's stays
  off that model (DDP takes one hook). A forward of a model in `eval()` mode with gradients
  on trains if a backward follows it before the next forward or batch; else it evaluated.
- `torch.autograd.backward` (which `loss.backward()` calls): with no DDP model, the phases:
  forward from the step's batch (or its start) to the backward call, backward the call
  itself; the gradient norm is then read from the optimizers' parameters at their step (the
  norm `clip_grad_norm_` saw, when the script clips). No module hook is used, so a
  `torch.compile`d model compiles as it would without trainspec.
- the DataLoader iterator's `__next__`: data wait and samples per step (the first dimension
  of each batch a step trains on: the batch each forward with gradients trains on, told by
  its input (without DDP, each backward's, the oldest asked for), so gradient
  accumulation's micro-batches and loaders zipped together add up, a loop that reads one
  batch ahead counts the batch it trains on and an evaluation loop under `no_grad` does not;
  `runtime/batches.py`). A step that reads no batch and takes none (tensors in memory, after
  a loader's evaluation or warm-up) counts its forwards' inputs.
- global optimizer step hooks: the step boundary (forward end -> optimizer pre-hook is
  backward; pre -> post hook is the optimizer phase). A step is over once every optimizer
  the script steps has stepped in it, so several optimizers make one step; it is closed at
  what comes next (a batch, a forward or backward, an optimizer stepping again), so an
  optimizer that steps for the first time after the others (every other batch, or unfrozen
  mid-run) joins the step it stepped in. An optimizer step with a closure (LBFGS) times the
  closure's forward and backward as those phases, not as the optimizer's.
- `GradScaler.step` (mixed precision's loss scaling): an optimizer step the scaler skips for
  inf or NaN gradients still ends the training step, with an `optimizer_step_skipped` event
  (it merged into the next step, which then reported half its samples at twice its time).
  A fused optimizer (`fused=True`) is stepped even then and skips inside its kernel: its
  step ends as usual, with no such event (reading the scaler's verdict would wait on the
  device at every step); the non-finite gradients still raise `nonfinite_gradients`.
- `torch.distributed.destroy_process_group`: closes trainspec first, every rank in step.
- DDP's shadow backward under `join()` (uneven inputs): the rank's data ran out, its last
  step is over, and the passes it shadows are none of its steps (`hook_wiring.watch_join`).
- `sys.excepthook`: an exception the script does not catch fails the step it ran in (a
  `step_failed` fault, as in the explicit API's `step()` block); a script that replaced the
  hook is seen ending at exit all the same (`sys.last_value`, `runtime/exit_status.py`).
- `sys.exit` and the `exit()` builtin: a failing code (not 0, not None) that ends the
  process fails the step in progress as that exception does (`on_exit`); one the script
  catches does not. Not seen: `raise SystemExit(code)` written in the script, `os._exit`.

A script that calls `trainspec.init()` itself measures itself: the zero-code layer stands
down (`stand_down`) and the script's own `step()` blocks and `wrap()` take over, in the one
session (the script's `wrap` of a model the layer already hooked keeps that hook).
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from trainspec.runtime.batches import PendingBatches, batch_size
from trainspec.runtime.exit_status import ExitStatus

log = logging.getLogger("trainspec.runtime")
_installed: AutoInstrumentation | None = None
# Phase marks kept for step 0 before the session starts (`_timing`); past this, started anew.
EARLY_MARKS_MAX = 256


@dataclasses.dataclass
class _Provisional:
    """A DDP forward of a model in `eval()` mode with gradients on, not yet told apart:
    training (frozen batch-norm or dropout fine-tuning: a backward follows) or an evaluation
    that leaves gradients on (the next forward or batch read comes first)."""

    inputs: Any
    began: float  # wall time
    ctx: Any  # the step it ran in (None before the session), and marks on its clock
    start: Any = None
    end: Any = None


def installed() -> AutoInstrumentation | None:
    """The zero-code instrumentation of this process (`trainspec run`), if any."""
    return _installed


class AutoInstrumentation:
    def __init__(self, *, group_only: bool = False) -> None:
        # A multiprocessing worker: a rank once it makes a process group, and never measured
        # before (a pool worker training a model of its own is not the job's rank 0).
        self.group_only = group_only
        self.session: Any = None
        self.ctx: Any = None
        self._batches = PendingBatches()  # read, and not yet taken by a training forward
        self._step_samples = 0
        self.ddp_hooked = False  # a DDP model reports its forwards (else: every batch counts)
        self.optimizer_steps = 0  # post-hook calls: how a skipped step is told from a taken one
        self._pending_wait = 0.0
        self._forward_done = False
        self._starting = False
        self._stepped_at: float | None = None  # an optimizer stepped; the step ends soon
        self._stepped: set[int] = set()  # ids of the optimizers that stepped in this step
        self._optimizers: set[int] = set()  # ids of every optimizer seen stepping
        self._steps_done = 0
        self._train_thread: int | None = None  # the thread that steps the optimizers
        self.explicit = False  # the script calls trainspec itself: these hooks stand down
        self.forked = False  # a process forked from the instrumented one (a loader worker)
        # The open step read a DataLoader batch with gradients on (since its last forward
        # under no_grad: an evaluation's batches), or a training forward in it took one: its
        # samples are its loaders' batches. A step with neither (a loop over tensors in
        # memory, after a loader's evaluation or warm-up) counts its forwards' inputs, as a
        # script with no DataLoader does (it counted 0 once any loader had given a batch).
        self._step_read = False
        self._step_took = False
        self._forward_open = False  # a training forward is being timed
        # The open step has not trained yet (no training batch or forward since the last
        # step ended), and an evaluation ran in it: it starts at its first training batch.
        self._trained_in_step = False
        self._evaluated_before_training = False
        # With DDP, the request time of the first batch read (gradients on) since the last
        # forward: where the step's training starts if a training forward takes it.
        self._first_request: float | None = None
        self._in_optimizer: int | None = None  # id of the optimizer stepping now (a closure)
        self._post_mark: Any = None  # clock mark at the latest optimizer step's end
        # Before a session that starts at the first optimizer step (a torchrun worker with no
        # process group): step 0's phases and start, handed to the session when it starts.
        self._early: Any = None  # StepTiming on the host clock
        self._early_start: float | None = None
        self._first_marked = False  # step 0 begins at the first batch or training forward
        # This step's clips (since its last backward began; handed to each optimizer's read):
        self._clipped: dict[int, Any] = {}  # id(param) -> its gradient's norm before a clip
        self._clips: list[Any] = []  # this step's L2 clips (collector.gradients.ClipRecord)
        self.failures = 0  # entry points that raised (contained: the script never sees them)
        self._optimizer_norm: Any = None  # collector.gradients.OptimizerGradientNorm, no DDP
        # DDP models whose gradient hook goes on at their first forward with gradients on
        # (`_attach_pending`): a script that registers its own hook before that keeps it.
        self._hook_pending: weakref.WeakSet[Any] = weakref.WeakSet()
        self._registering = False  # trainspec registers its own hook now (not the script)
        # A DDP forward of a model in `eval()` mode with gradients on: training (a backward
        # follows) or an evaluation (the next forward or batch comes first). Its inputs,
        # start (wall time), and its start and end marks on the step's clock.
        self._provisional: _Provisional | None = None
        self.exits = ExitStatus()  # what the process is seen to end on, read at exit

    @property
    def stood_down(self) -> bool:
        """Whether these hooks do nothing: the script measures itself, or this process is
        a fork of the instrumented one (a DataLoader worker calling a transform module)."""
        return self.explicit or self.forked

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) inherits the patched torch but is not the
        job: its module calls started sessions of their own, written as rank 0."""
        self.forked = True

    def _mark_first_step(self, begun: float) -> None:
        """Step 0 begins at the job's first batch request or training forward, not when
        the session started: set-up after the process group (loading data or a checkpoint)
        made step 0 minutes long."""
        if self._first_marked or self._steps_done != 0 or self.stood_down:
            return
        if self.ctx is not None:
            self._first_marked = True
            self.ctx.wall_start = begun
        elif self.session is None:  # a torchrun worker with no group: the session starts later
            self._first_marked = True
            self._early_start = begun

    def _timing(self) -> Any:
        """The open step's phase timing; before the session starts (a torchrun worker with no
        process group starts it at its first optimizer step), step 0's early timing, so
        that step is measured whole (its forward and backward had no value)."""
        if self.ctx is not None:
            return self.ctx.timing
        if self.session is not None or self.stood_down or self.group_only:
            return None
        marks = 0 if self._early is None else sum(map(len, self._early.marks.values()))
        if self._early is None or marks > EARLY_MARKS_MAX:
            # (a script that never steps an optimizer, updating its parameters by hand,
            # would add a forward and a backward pair a batch, for ever)
            from trainspec.runtime.step_timer import HostPhaseClock, StepTiming

            self._early = StepTiming(HostPhaseClock())
        return self._early

    def _take_early(self, group_made: bool, setup_s: float) -> None:
        """The session started: step 0's phases timed before it are its (a start without a
        group, at the first optimizer step), with its start moved later by trainspec's own
        set-up; a start at the process group forgets them (a warm-up before the group)."""
        early, begun = self._early, self._early_start
        self._early, self._early_start = None, None
        if self.ctx is None:
            return
        if group_made or early is None or not self.ctx.timing.take(early):
            if begun is not None:
                self._first_marked = False  # step 0 begins at its first batch or forward
            return
        if begun is not None:
            self.ctx.wall_start = begun + setup_s

    @property
    def alone(self) -> bool:
        """A process no launcher started (no RANK), on its main thread now, that may be
        measured without a process group (not a multiprocessing worker)."""
        if self.group_only or "RANK" in os.environ:
            return False
        return threading.current_thread() is threading.main_thread()

    @property
    def starting(self) -> bool:
        """Whether this layer is inside its own `trainspec.init` call now."""
        return self._starting

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

    # -- session lifecycle -----------------------------------------------------------------
    def start(self, group_made: bool = True) -> None:
        """Start the session: right after the script made its process group, or, for a
        script that made none by its first optimizer step (`group_made=False`), without
        one: trainspec never makes a group the script did not ask for (a rank training
        alone waited at its first step for peers that never joined)."""
        if self.session is None and not self._starting and not self.explicit:
            before = time.time()  # trainspec's own set-up, its imports too, is no step's
            from trainspec.runtime.init import init

            self._starting = True
            try:
                self.session = init(create_process_group=group_made)
            finally:
                self._starting = False
            self.ctx = self.session.begin_step()
            if not self.ddp_hooked:
                self.ctx.timing.begin("forward")
            self._take_early(group_made, time.time() - before)
            # The last step ends at exit, or fails: registered after init's own close, so
            # run before it (and after the script's `sys.excepthook`).
            atexit.register(contained, self, self.on_exit)

    def on_group_made(self) -> None:
        """The script made its process group: the session starts. A worker forked before
        its parent measured anything (`multiprocessing.Process`, `start_processes(...,
        start_method="fork")`, a forkserver's worker) is a rank from here on, though it
        inherited the stand-down of a fork: only the job's ranks make process groups, a
        DataLoader worker never does."""
        if self.forked and self.session is None and not self.explicit:
            self.forked = False
            self.group_only = True
        if self.stood_down:
            return
        started = self.session is None
        self.start()
        if self.group_only and started and self.session is not None:
            # As for a torchrun rank: the processes this one starts are not the job.
            os.environ.pop("TRAINSPEC_AUTO", None)
            _close_at_worker_exit(self)

    def close(self) -> None:
        if self.session is not None:
            self._finish_step()
            self.session.close(aligned=True)

    def on_uncaught(self, exc: BaseException) -> None:
        """The script ends in an exception it did not catch (`sys.excepthook`): the step it
        was in failed, a `step_failed` fault as in a `step()` block of the explicit API
        (none was stored: `trainspec validate --strict` failed the run on that rank's lost
        step, QA 2026-11-27). A step whose optimizers had all stepped is over, and stored;
        the one after it, begun as it ended, is the one that failed."""
        if self.stood_down or self.session is None or self.ctx is None:
            return
        over = self._steps_done == 0 or self._stepped >= self._optimizers
        if self._stepped_at is not None and self._in_optimizer is None and over:
            self._finish_step()
        ctx, self.ctx = self.ctx, None  # (the process is ending: no step begins after it)
        self._stepped_at = None
        self.session.fail_step(ctx, exc)

    def on_exit(self) -> None:
        """The process ends (atexit). On a failure (`ExitStatus.ending`: an exception that
        left the script, its `sys.excepthook` the script's own; `sys.exit` with a failing
        code, whose `SystemExit` no excepthook sees), the step in progress failed, by
        `on_uncaught`'s rule, and only once (after `on_uncaught` no step is open). The step
        in progress is the open one: from the end of the last (every optimizer it steps
        stepped) to the end of the next, so a failing exit after the last optimizer step,
        in an evaluation or a save, fails the step that would have come next, as an
        exception there does. Otherwise (a normal end, `sys.exit(0)`, an exit not seen) the
        last step, if an optimizer stepped in it, is stored, and the step begun as it ended
        is dropped unrecorded."""
        failure = self.exits.ending()
        if failure is not None:
            self.on_uncaught(failure)
        self._finish_step()

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

    def _on_train_thread(self) -> bool:
        """The thread that steps the optimizers; before the first step, the main thread."""
        train = self._train_thread or threading.main_thread().ident
        return train == threading.get_ident()

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

    def _finish_step(self) -> None:
        if self._stepped_at is None or self.ctx is None or self.session is None or self.stood_down:
            return
        ended, self._stepped_at = self._stepped_at, None
        self._stepped.clear()
        self._steps_done += 1
        self.ctx.samples = self._step_samples
        self._step_samples = 0
        self.session._data_wait += self._pending_wait
        self._pending_wait = 0.0
        self.session.end_step(self.ctx, wall_end=ended)
        self._forward_done = False
        self._trained_in_step = self._evaluated_before_training = False
        self._step_read = self._step_took = False
        self._first_request = None
        self.ctx = self.session.begin_step()
        self.ctx.wall_start = ended  # steps tile the run: the next one began as this ended
        mark, self._post_mark = self._post_mark, None
        if not self.ddp_hooked:  # tentative, from the step's end: a batch read re-begins it
            self.ctx.timing.begin("forward", at=mark)


def _close_at_worker_exit(auto: AutoInstrumentation) -> None:
    """A multiprocessing worker started by fork or a forkserver ends in `os._exit`, where
    no atexit handler runs (its steps were never flushed); multiprocessing's own exit
    finalizers run there, and in a spawned worker before its atexit handlers (a close that
    has run once does nothing more)."""
    import multiprocessing
    from multiprocessing import util

    if multiprocessing.parent_process() is None:  # not started by multiprocessing
        return

    def close_unaligned() -> None:
        session = auto.session
        if session is not None and not auto.stood_down:
            auto._finish_step()
            session.close(aligned=False, timeout_s=5.0)  # as init's atexit handler

    util.Finalize(None, close_unaligned, exitpriority=0)


def contained(auto: AutoInstrumentation, entry: Any, *args: Any) -> Any:
    """Call one of the layer's entry points from a patched place in torch. Whatever it
    raises is trainspec's failure, never the script's: logged once, counted, swallowed (a
    nested tensor's `shape`, or parameters on two devices, ended scripts that ran fine
    without trainspec)."""
    try:
        return entry(*args)
    except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
        auto.failures += 1
        if auto.failures == 1:
            log.warning("trainspec: the zero-code instrumentation failed and the script goes on "
                        "(%s: %s)", type(exc).__name__, exc,
                        exc_info=os.environ.get("TRAINSPEC_DEBUG") == "1")  # fmt: skip
        return None


# The script registers its own communication hook on a DDP model whose first forward put
# trainspec's on it (DDP takes one, and said only "can only be called once").
SECOND_HOOK = (
    "trainspec registered its communication hook on this DDP model at its first forward, "
    "and DDP takes one: register the script's own hook before the model's first forward "
    "(trainspec's then stays off that model)"
)


def _comm_hook_registration(auto: AutoInstrumentation, original: Any) -> Any:
    """`DistributedDataParallel.register_comm_hook` (or its built-in variant), telling the
    layer of a script's own hook before it goes on."""

    @functools.wraps(original)
    def register(self: Any, *args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_script_comm_hook, self)
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            from trainspec.runtime.hook_wiring import hook_of

            if auto._registering or hook_of(self) is None:
                raise
            raise RuntimeError(SECOND_HOOK) from exc

    return register


def _join_shadow_pass(auto: AutoInstrumentation, original: Any) -> Any:
    """`DistributedDataParallel`'s shadow backward under `join()`, telling the layer first
    (`on_shadow_pass`)."""

    @functools.wraps(original)
    def shadow_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_shadow_pass)
        return original(self, *args, **kwargs)

    return shadow_pass


def _excepthook(auto: AutoInstrumentation, previous: Any) -> Any:
    """`sys.excepthook`, telling the layer of the script's uncaught exception (`on_uncaught`)
    before the hook it replaces prints it."""

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        contained(auto, auto.on_uncaught, exc)
        previous(kind, exc, tb)

    return excepthook


def _exit_watched(auto: AutoInstrumentation, original: Any) -> Any:
    """`sys.exit` (or the `exit()` builtin's call), marking the `SystemExit` it raises so
    that one leaving the script is seen at exit (`ExitStatus.watch`); raised as it was."""

    @functools.wraps(original)
    def exit(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except SystemExit as exc:  # (unbound at the block's end: no cycle keeps it alive)
            contained(auto, auto.exits.watch, exc)
            raise

    return exit


def torch_grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _is_l2(norm_type: Any) -> bool:
    """Whether a `clip_grad_norm_` norm type is the L2 norm (2, 2.0, "2"; not inf or 1)."""
    try:
        return float(norm_type) == 2.0
    except (TypeError, ValueError):
        return False


def install(*, group_only: bool = False) -> AutoInstrumentation:
    """Patch torch for this process; returns the instrumentation object. `group_only`: a
    multiprocessing worker, measured from its process group on (`AutoInstrumentation`)."""
    # Every import first: a torch without one of these leaves the script wholly unpatched.
    import torch
    import torch.distributed as dist
    from torch.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

    from trainspec.runtime.hook_wiring import SHADOW_PASS

    global _installed
    auto = _installed = AutoInstrumentation(group_only=group_only)

    original_init_pg = dist.init_process_group

    @functools.wraps(original_init_pg)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original_init_pg(*args, **kwargs)
        contained(auto, auto.on_group_made)
        return result

    dist.init_process_group = init_process_group

    original_destroy = dist.destroy_process_group

    @functools.wraps(original_destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.close)
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    shadow_pass = getattr(DistributedDataParallel, SHADOW_PASS, None)
    if shadow_pass is not None:  # (wrapped again per model by `hook_wiring.watch_join`)
        setattr(DistributedDataParallel, SHADOW_PASS, _join_shadow_pass(auto, shadow_pass))

    sys.excepthook = _excepthook(auto, sys.excepthook)
    sys.exit = _exit_watched(auto, sys.exit)
    quitter = type(getattr(builtins, "exit", None))  # `_sitebuiltins.Quitter`, with `site`
    if quitter.__module__ == "_sitebuiltins":
        quitter.__call__ = _exit_watched(auto, quitter.__call__)  # type: ignore[method-assign]

    original_ddp_init = DistributedDataParallel.__init__

    @functools.wraps(original_ddp_init)
    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_ddp_init(self, *args, **kwargs)
        contained(auto, auto.on_ddp_model, self)

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    for name in ("register_comm_hook", "_register_builtin_comm_hook"):
        original = getattr(DistributedDataParallel, name, None)
        if original is not None:
            setattr(DistributedDataParallel, name, _comm_hook_registration(auto, original))

    original_next = dataloader._BaseDataLoaderIter.__next__

    @functools.wraps(original_next)
    def next_batch(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            batch = original_next(self)
        except StopIteration:
            contained(auto, auto.on_loader_end, self)
            raise
        contained(auto, auto.on_batch, batch, time.perf_counter() - t0, self)
        return batch

    dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]

    from torch.nn.utils import clip_grad

    original_clip = clip_grad.clip_grad_norm_

    @functools.wraps(original_clip)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)  # a generator would be used up by the read
        norm_type = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)
        # An L2 clip's own result is the norm before it, where nothing clipped or read those
        # gradients before it in this step (a check that fails takes the per-parameter read).
        if _is_l2(norm_type) and contained(auto, auto.clip_reusable, parameters):
            total = original_clip(parameters, *args, **kwargs)
            contained(auto, auto.after_clip, parameters, total)
            return total
        contained(auto, auto.before_clip, parameters)
        return original_clip(parameters, *args, **kwargs)

    original_backward = torch.autograd.backward

    @functools.wraps(original_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_backward_start)
        result = original_backward(*args, **kwargs)
        contained(auto, auto.on_backward_end)
        return result

    torch.autograd.backward = backward

    clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    os.register_at_fork(after_in_child=auto.after_fork_in_child)

    original_scaler_step = GradScaler.step

    @functools.wraps(original_scaler_step)
    def scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        stepped = auto.optimizer_steps
        result = original_scaler_step(self, optimizer, *args, **kwargs)
        if auto.optimizer_steps == stepped:  # skipped: inf or NaN in the unscaled gradients
            contained(auto, auto.on_optimizer_skipped, optimizer)
        return result

    GradScaler.step = scaler_step  # type: ignore[method-assign]

    register_optimizer_step_pre_hook(lambda opt, a, k: contained(auto, auto.on_optimizer_pre, opt))
    register_optimizer_step_post_hook(
        lambda opt, a, k: contained(auto, auto.on_optimizer_post, opt)
    )
    # A script that never destroys its process group is flushed by init's atexit handler.
    return auto
