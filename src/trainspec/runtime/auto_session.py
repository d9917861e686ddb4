"""The zero-code layer's state and its session's lifecycle (`runtime/auto.py`): what an
`AutoInstrumentation` knows between the patched calls, when its session starts (at the
process group, or without one at the first step), how a step ends and is stored, and how the
process's end (normal, an uncaught exception, a failing exit, `os._exit`, a multiprocessing
worker's `os._exit`) closes the last step."""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import weakref
from typing import Any

from trainspec.runtime.auto_containment import contained
from trainspec.runtime.batches import PendingBatches
from trainspec.runtime.exit_status import ExitStatus, HardExit

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


class AutoSessionLifecycle:
    """The state of the zero-code layer and its session's start, step ends and close; the
    patched points that drive it are `AutoInstrumentation`'s."""

    def __init__(self, *, group_only: bool = False) -> None:
        # A multiprocessing worker: a rank once it makes a process group, and never measured
        # before (a pool worker training a model of its own is not the job's rank 0).
        self.group_only = group_only
        self.session: Any = None
        self.session_pid: int | None = None  # the process that started `session`
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
    def owns_session(self) -> bool:
        """Whether this process started the session, and it is open: not a process forked
        from it (a DataLoader worker holds a copy of the session, and ends in `os._exit`)."""
        session = self.session
        return session is not None and self.session_pid == os.getpid() and not session.closed

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
            self.session_pid = os.getpid()
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

    def on_os_exit(self, code: int, timeout_s: float) -> None:
        """`os._exit(code)` in the process whose session it is (`owns_session`): no atexit
        handler runs after it. A failing code (not 0) fails the step in progress as a
        failing `sys.exit` does (`on_exit`, with a `HardExit`); then the last step, if an
        optimizer stepped in it, is stored and the session closed, unaligned (the other
        ranks are not leaving with this one), its flush given `timeout_s`."""
        session = self.session
        if session is None or session.closed:
            return
        if code != 0:
            self.on_uncaught(HardExit(code))
        self._finish_step()
        session.close(aligned=False, timeout_s=timeout_s)

    def _on_train_thread(self) -> bool:
        """The thread that steps the optimizers; before the first step, the main thread."""
        train = self._train_thread or threading.main_thread().ident
        return train == threading.get_ident()

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


def _close_at_worker_exit(auto: AutoSessionLifecycle) -> None:
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
