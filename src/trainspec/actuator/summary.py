"""The compact per-window summary each rank contributes to the control plane.

A window is K optimizer steps. `WindowAccumulator` folds this rank's `StepRecord`s into one
`RankSummary`; `RankSummary.to_tensor` packs it into a fixed-length float64 vector so one
all-gather on the control group moves every rank's window at once (a few hundred bytes).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields

from trainspec.collector.records import StepRecord

# Health flags, a bitmask: what a rank saw that every rank must learn about.
FLAG_NAN_LOSS = 1
FLAG_PREEMPT = 2
FLAG_HARDWARE = 4
FLAG_NAMES = {
    FLAG_NAN_LOSS: "nan_loss",
    FLAG_PREEMPT: "preemption",
    FLAG_HARDWARE: "hardware",
}


@dataclass
class RankSummary:
    """One rank's window. Times are sums over the window's steps, in seconds."""

    rank: int = 0
    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0  # forward + backward - exposed communication: local work only
    duration_s: float = 0.0
    data_wait_s: float = 0.0
    comm_exposed_s: float = 0.0
    memory_pressure: float = 0.0  # reserved / limit, 0..1 (max over the window)
    alloc_retries: float = 0.0
    grad_norm: float = math.nan  # last step's global gradient norm
    loss_mean: float = math.nan
    loss_last: float = math.nan
    flags: int = 0
    plan_version: int = 0  # plans applied so far; ranks that disagree stop the controller
    share: int = 0  # this rank's samples per step under the current plan
    # last measured checkpoint cost (stall + commit); before any: +inf (checkpointing.PENDING)
    # while a save is in flight, NaN when none was made or every one failed
    checkpoint_cost_s: float = math.nan
    step_compute_median_s: float = (
        math.nan
    )  # median over the window's steps: robust to one bad step
    micro_batch: int = 0  # this rank's micro-batch limit at the window's end (0: whole share)
    oom_micro_batch: int = 0  # smallest micro-batch that ran out of memory here so far (0: none)
    probe_latency_s: float = math.nan  # median of this rank's latency-probe readings in the window

    @property
    def per_sample_s(self) -> float:
        """Local compute seconds per sample (median step over mean samples per step): the
        straggler detector's measure. A single slow step (a page fault, a neighbour's burst)
        moves a window's median little; a slow rank moves it every step."""
        if self.samples <= 0 or self.steps <= 0:
            return math.nan
        per_step = self.step_compute_median_s
        if not math.isfinite(per_step):
            per_step = self.compute_s / self.steps
        return per_step * self.steps / self.samples

    def share_of_step(self, seconds: float) -> float:
        return seconds / self.duration_s if self.duration_s > 0 else 0.0

    def to_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> RankSummary:
        kwargs: dict[str, float | int] = {}
        for f, v in zip(fields(cls), values, strict=True):
            kwargs[f.name] = int(v) if f.type == "int" else float(v)
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))


def step_compute_s(rec: StepRecord) -> float:
    """Local compute of one step: forward and backward, less the wait for other ranks.

    The backward phase ends when the last bucket's all-reduce is back; the part after the
    last bucket became ready locally (`comm_exposed_s`) is waiting, not work. Without phase
    timings, the step less its data wait and exposed communication stands in.
    """
    exposed = rec.comm_exposed_s or 0.0
    if rec.forward_s is not None and rec.backward_s is not None:
        return max(0.0, rec.forward_s + rec.backward_s - exposed)
    return max(0.0, rec.duration_s - rec.data_wait_s - exposed)


class WindowAccumulator:
    """Folds step records into the current window's summary; `take` starts the next one."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._current = RankSummary(rank=rank)
        self._losses: list[float] = []
        self._computes: list[float] = []
        self._timed_from = 0  # steps before this one add no timings (discard_before)
        self._no_loss: set[int] = set()  # steps whose reported loss is no value (mark_no_loss)

    def add(self, rec: StepRecord) -> None:
        s = self._current
        self._fold_health(rec)
        if rec.step < self._timed_from:
            return
        s.steps += 1
        s.samples += rec.samples
        compute = step_compute_s(rec)
        s.compute_s += compute
        self._computes.append(compute)
        s.duration_s += rec.duration_s
        s.data_wait_s += rec.data_wait_s
        s.comm_exposed_s += rec.comm_exposed_s or 0.0

    def mark_no_loss(self, step: int) -> None:
        """Step `step` ran an empty share (one placeholder sample at weight 0): whatever loss
        the script reports for it is no value, not this rank's loss. It was 0.0, stored and
        averaged into the window means the loss detector and compression policy read."""
        self._no_loss.add(step)

    def _fold_health(self, rec: StepRecord) -> None:
        s = self._current
        if rec.grad_norm is not None:
            s.grad_norm = rec.grad_norm
        if self._no_loss:  # records arrive in step order: earlier marks are spent
            empty = rec.step in self._no_loss
            self._no_loss = {step for step in self._no_loss if step > rec.step}
            if empty:
                return
        if rec.loss is not None:
            if math.isfinite(rec.loss):
                self._losses.append(rec.loss)
                s.loss_last = rec.loss
            else:
                s.flags |= FLAG_NAN_LOSS

    def raise_flag(self, flag: int) -> None:
        self._current.flags |= flag

    def discard_before(self, step: int) -> None:
        """Leave the timings of steps before `step` out of this window, those folded in so
        far and those still to come (on CUDA a step's record arrives once its events have
        completed, a boundary or more late): they ran under a plan just replaced. Losses,
        the gradient norm and raised flags stay: a loss spike, a NaN or a preemption notice
        must still reach the next window."""
        s = self._current
        s.steps = s.samples = 0
        s.compute_s = s.duration_s = s.data_wait_s = s.comm_exposed_s = 0.0
        self._computes = []
        self._timed_from = step

    def take(
        self,
        *,
        plan_version: int,
        share: int,
        memory: tuple[float, float],
        ckpt_cost_s: float,
        micro: tuple[int, int] = (0, 0),
        probe_latency_s: float = math.nan,
    ) -> RankSummary:
        """Close the window; `micro` is (micro-batch limit, smallest OOM micro-batch)."""
        s = self._current
        s.micro_batch, s.oom_micro_batch = micro
        s.probe_latency_s = probe_latency_s
        if self._losses:
            s.loss_mean = sum(self._losses) / len(self._losses)
        s.plan_version, s.share = plan_version, share
        s.memory_pressure, s.alloc_retries = memory
        s.checkpoint_cost_s = ckpt_cost_s
        if self._computes:
            s.step_compute_median_s = statistics.median(self._computes)
        self._current, self._losses, self._computes = RankSummary(rank=self.rank), [], []
        return s
