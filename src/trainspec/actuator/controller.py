"""The controller: one per rank, run at the step boundary, the same plan on every rank.

Every `window_steps` steps each rank folds its step records into a `RankSummary` and launches
the all-gather of the summaries on the control group; at the next step's boundary it reads
them, and every rank runs the same detectors and policies on the same data, so every rank
applies the same actions before the same step (one step after the window closed: the gather
runs beside that step, gather.py). The timings of the steps made under the old plan are
left out of the next window when an action changed the plan (rebalance, compression level,
micro-batch).
A gather that fails, or ranks whose applied-plan counts differ (one rank could not apply an
action), is recorded as an event and stops the controller on every rank: the job goes on
with the plan it has (fail open). Dry run detects, decides and records, and applies nothing.

Events: anomalies and advice are recorded by rank 0 (one shared decision, evidence from
every rank); an applied action is recorded by every rank (each rank's change is a fact).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from trainspec.actuator.actions import ActionError, Targets, apply
from trainspec.actuator.bottlenecks import CommBoundDetector, InputBoundDetector, exposed_comm_share
from trainspec.actuator.checkpointing import CheckpointPolicy
from trainspec.actuator.compression import CompressionPolicy
from trainspec.actuator.findings import Action, Finding
from trainspec.actuator.gather import GatherError, PendingGather, start_gather
from trainspec.actuator.latency_spike import LatencySpikeDetector
from trainspec.actuator.loss import LossSpikeDetector
from trainspec.actuator.memory import MemoryPressureDetector
from trainspec.actuator.memory_policy import MemoryPolicy
from trainspec.actuator.rebalance import RebalancePolicy
from trainspec.actuator.regime import GradientRegimeDetector
from trainspec.actuator.straggler import StragglerDetector
from trainspec.actuator.summary import (
    FLAG_HARDWARE,
    FLAG_PREEMPT,
    RankSummary,
    WindowAccumulator,
)
from trainspec.collector.records import StepRecord
from trainspec.config import ActuatorConfig

log = logging.getLogger("trainspec.actuator")

EmitFn = Callable[
    ..., None
]  # session.event(kind, name, reason, *, severity, evidence, before, after)
GatherFn = Callable[[RankSummary, Any], PendingGather]  # launches; the result waits

_ADVICE = {
    "input_bound": "more DataLoader workers, prefetch_factor, pin_memory, or a faster source",
    "latency_spike": "checking the links and host load of the ranks named (on every rank: the "
    "network, or load on every host); the probe times a small all-reduce, so this is "
    "latency, not bandwidth",
}
# Advised only when the memory policy is off (actuator.memory = false) or has no plan to act on.
_MEMORY_ADVICE = "a smaller micro-batch with more accumulation steps (same global batch)"


# Actions that change how a step runs; a checkpoint does not.
_PLAN_KINDS = frozenset({"rebalance", "compression", "memory"})


@dataclass
class ControlCost:
    windows: int = 0
    steps: int = 0
    gather_s: float = 0.0
    decide_s: float = 0.0

    @property
    def per_step_s(self) -> float:
        return (self.gather_s + self.decide_s) / self.steps if self.steps else 0.0


class Controller:
    def __init__(
        self,
        config: ActuatorConfig,
        *,
        world_size: int,
        group: Any,
        targets: Targets,
        emit: EmitFn,
        memory_probe: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
        latency_probe: Callable[[], float] = lambda: math.nan,
        checkpoint_interval: Callable[[float, float], int] | None = None,
        gather: GatherFn = start_gather,
        int8_block: int | None = None,
    ) -> None:
        """`int8_block` is the job's `kernels.int8_block_size`, what a plain `int8` rung of
        `config.compression_ladder` means."""
        if config.window_steps < 1:
            raise ValueError(f"actuator.window_steps must be at least 1, got {config.window_steps}")
        self.config = config
        self.rank = targets.rank
        self.world_size = world_size
        self.group = group
        self.targets = targets
        self.emit = emit
        self.memory_probe = memory_probe
        self.latency_probe = latency_probe
        self.gather = gather
        self.dry_run = config.dry_run
        self.stopped: str | None = None  # why the controller stopped, once it has
        self.paused = False  # an operator's pause: set on every rank at one step
        self.plan_version = 0
        self.cost = ControlCost()
        self.history: list[dict[str, Any]] = []
        self._acc = WindowAccumulator(targets.rank)
        self._pending: PendingGather | None = None
        self._pending_step = 0
        self._window = 0
        k = config.patience
        self.straggler = StragglerDetector(
            config.straggler_score, config.straggler_exit_score, patience=k
        )
        self.comm = CommBoundDetector(config.comm_bound_share, config.comm_bound_share * 2 / 3, k)
        self.input = InputBoundDetector(config.input_bound_share, config.input_bound_share / 2, k)
        self.regime = GradientRegimeDetector(eta=config.accordion_eta)
        self.loss = LossSpikeDetector(spike_factor=config.loss_spike_factor)
        self.memory = MemoryPressureDetector(
            config.memory_pressure, config.memory_pressure - 0.07, k
        )
        self.latency = LatencySpikeDetector(
            config.latency_spike_factor, config.latency_spike_floor_s, patience=k
        )
        self.rebalance = (
            RebalancePolicy(
                targets.global_batch,
                world_size,
                min_gain=config.rebalance_min_gain,
                follow_min_gain=config.rebalance_follow_min_gain,
                patience=k,
                max_change=config.rebalance_max_change,
                cooldown=config.rebalance_cooldown,
                min_share=config.min_share,
            )
            if config.rebalance and self._shares_can_move(config.min_share, targets.global_batch)
            else None
        )
        ladder = tuple(x.strip() for x in config.compression_ladder.split(",") if x.strip())
        self.compression = (
            CompressionPolicy(ladder=ladder, int8_block=int8_block) if config.compression else None
        )
        plan = targets.micro_batch
        self.memory_policy = (
            MemoryPolicy(
                plan.configured if plan is not None else config.micro_batch,
                plan.minimum if plan is not None else config.min_micro_batch,
                patience=k,
                cooldown=config.memory_cooldown,
            )
            if config.memory and plan is not None
            else None
        )
        self.checkpointing = (
            CheckpointPolicy(checkpoint_interval)
            if config.checkpoint and checkpoint_interval is not None and targets.checkpoint
            else None
        )

    # ---- inputs from the training loop --------------------------------------------------
    def on_record(self, rec: StepRecord) -> None:
        self._acc.add(rec)

    def no_loss_at(self, step: int) -> None:
        """Step `step` (the session's index) ran an empty share: its loss is left out of the
        window (summary.py, `mark_no_loss`)."""
        self._acc.mark_no_loss(step)

    def raise_flag(self, flag: int) -> None:
        """Report a health condition (FLAG_PREEMPT, FLAG_HARDWARE) with the next window."""
        self._acc.raise_flag(flag)

    def current_shares(self) -> list[int]:
        sampler = self.targets.sampler
        if sampler is not None:
            return list(sampler.shares)
        base, extra = divmod(self.targets.global_batch, self.world_size)
        return [base + (1 if r < extra else 0) for r in range(self.world_size)]

    def _micro(self) -> tuple[int, int]:
        plan = self.targets.micro_batch
        return (plan.limit, plan.oom_at) if plan is not None else (0, 0)

    # ---- the step boundary -----------------------------------------------------------------
    def on_boundary(self, step_index: int) -> None:
        """Called after each step with the number of steps done: decides on the gather
        launched at the previous boundary, and every window_steps launches the next."""
        if self._pending is not None:
            self._finish_gather(step_index)
        if step_index % self.config.window_steps:
            return
        if self.stopped is not None or self.paused:
            self.latency_probe()  # a skipped window's readings are not the next one's
            return
        t0 = time.perf_counter()
        summary = self._acc.take(
            plan_version=self.plan_version,
            share=self.current_shares()[self.rank],
            memory=self.memory_probe(),
            ckpt_cost_s=self.targets.latest_checkpoint_cost() or math.nan,
            micro=self._micro(),
            probe_latency_s=self.latency_probe(),
        )
        try:
            self._pending, self._pending_step = self.gather(summary, self.group), step_index
        except GatherError as exc:
            self._stop(f"{exc}; no decision this window and none after", step_index)
        self.cost.gather_s += time.perf_counter() - t0

    def _finish_gather(self, step_index: int) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        t0 = time.perf_counter()
        try:
            gathered = pending()
        except GatherError as exc:
            self._stop(f"{exc}; no decision this window and none after", step_index)
            return
        t1 = time.perf_counter()
        self.cost.gather_s += t1 - t0
        if self.stopped is None and not self.paused:
            applied = len(self.history)
            self._decide_and_apply(gathered, step_index)
            if any(h["applied"] and h["kind"] in _PLAN_KINDS for h in self.history[applied:]):
                self._acc.discard_before(step_index)  # those steps ran under the old plan
        else:  # no decision now: this rank's health flags must reach a later window
            self._acc.raise_flag(gathered[self.rank].flags)
        self.cost.decide_s += time.perf_counter() - t1
        self.cost.windows += 1
        self.cost.steps = step_index

    def close(self) -> None:
        """Wait for a gather still in flight (every rank launched it; its result is moot)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with contextlib.suppress(GatherError):
                pending()

    def _decide_and_apply(self, gathered: list[RankSummary], step: int) -> None:
        self._window += 1
        versions = sorted({s.plan_version for s in gathered})
        if len(versions) > 1:
            equal = self._equal_shares()
            self._stop(f"ranks disagree on the applied plan (versions {versions})"
                       + ("; shares back to equal on every rank" if equal else ""), step)  # fmt: skip
            return
        findings = self._detect(gathered)
        for f in findings:
            if self.rank == 0:
                evidence = {**f.evidence, "ranks": list(f.ranks)}
                reason = ("cleared: " if f.cleared else "") + f.reason
                self.emit("anomaly", f.kind, reason, severity=f.severity, evidence=evidence)
        for action in self._decide(gathered, findings, step):
            self._act(action, step)

    def _detect(self, s: list[RankSummary]) -> list[Finding]:
        found: list[Finding] = []
        for detector in (
            self.straggler,
            self.comm,
            self.input,
            self.regime,
            self.loss,
            self.memory,
            self.latency,
        ):
            found.extend(detector.observe(s))
        flags = 0
        for summary in s:
            flags |= summary.flags
        if flags & FLAG_PREEMPT:
            found.append(
                Finding("preemption", "a rank received a preemption signal", severity="error")
            )
        if flags & FLAG_HARDWARE:
            found.append(
                Finding("hardware", "a rank reported a hardware health fault", severity="error")
            )
        return found

    def _decide(self, s: list[RankSummary], findings: list[Finding], step: int) -> list[Action]:
        actions: list[Action] = []
        shares = self.current_shares()  # what every rank runs from this boundary on
        if self.rebalance is not None:
            straggling = bool(self.straggler.flagged)
            a = self.rebalance.decide(s, shares, straggling=straggling)
            actions += [a] if a else []
            if a is not None and self.targets.can("rebalance") and not self.dry_run:
                shares = [int(n) for n in a.after["shares"]]  # applied before the memory action
        if self.compression is not None and self.targets.hook is not None:
            a = self.compression.decide(
                s,
                self.targets.hook.level,
                comm_bound=self.comm.active,
                critical=self.regime.critical,
                exposed_share=exposed_comm_share(s),
            )
            actions += [a] if a else []
        advice = dict(_ADVICE)
        if self.memory_policy is not None:
            entered = [f for f in findings if f.kind == "memory_pressure" and not f.cleared]
            a = self.memory_policy.decide(
                s,
                entered=bool(entered),
                active=self.memory.active,
                pressed=self.memory.pressed,
                ranks=entered[0].ranks if entered else (),
                shares=shares,  # the plan and its record on the shares the ranks will run
            )
            actions += [a] if a else []
        else:
            advice["memory_pressure"] = _MEMORY_ADVICE
        if self.checkpointing is not None:  # last: it saves the plan the next step runs
            a = self.checkpointing.decide(s, step, findings)
            actions += [a] if a else []
        for f in findings:
            if f.kind in advice and not f.cleared:
                actions.append(
                    Action(
                        "advice",
                        f"{f.reason}; consider {advice[f.kind]}",
                        evidence=f.evidence,
                        ranks=f.ranks,
                    )
                )
        return actions

    def _act(self, action: Action, step: int) -> None:
        applies = action.changes_state and not self.dry_run and self.targets.can(action.kind)
        entry = {"step": step, "kind": action.kind, "applied": applies, **asdict(action)}
        self.history.append(entry)
        evidence = {**action.evidence, "ranks": list(action.ranks)}
        if not applies:
            if self.rank == 0:
                why = "dry run, not applied: " if self.dry_run and action.changes_state else ""
                if action.changes_state and not self.dry_run:
                    why = "no target to apply it to, advised only: "
                self.emit("action", action.kind, why + action.reason, evidence=evidence,
                          before=action.before, after=action.after)  # fmt: skip
            return
        try:
            apply(action, self.targets, step)
        except ActionError as exc:
            self.plan_version = -1  # every rank sees the mismatch at the next gather
            self.emit("action", action.kind, f"failed: {exc}", severity="error", evidence=evidence)
            return
        self.plan_version += 1
        self.emit("action", action.kind, action.reason, evidence=evidence,
                  before=action.before, after=action.after)  # fmt: skip

    def _shares_can_move(self, min_share: int, global_batch: int) -> bool:
        """The configured floor must fit the script's batch; where it does not, rebalancing
        is off for the run (a warning on every rank, an event from rank 0), not the job
        stopped: the global batch is the script's, known only here."""
        if min_share * self.world_size <= global_batch:
            return True
        reason = (
            f"rebalancing off: actuator.min_share {min_share} x {self.world_size} ranks "
            f"exceeds the global batch {global_batch}"
        )
        log.warning("trainspec: %s", reason)
        if self.rank == 0:  # anomalies are recorded once, by rank 0
            self.emit("anomaly", "config", reason, severity="warning",
                      evidence={"min_share": min_share, "world_size": self.world_size,
                                "global_batch": global_batch})  # fmt: skip
        return False

    def _equal_shares(self) -> bool:
        """Every rank back to the equal split, where the plans parted: ranks on different
        shares train some samples twice and skip others, silently, to the end of the run.
        Every rank gathered the same versions, so every rank does this at this boundary."""
        t = self.targets
        if not t.can("rebalance"):
            return False
        equal = t.sampler.equal_shares()
        if tuple(t.sampler.shares) == tuple(equal):
            return False
        t.sampler.set_shares(equal)
        t.hook.set_shares(equal[t.rank], t.global_batch)
        return True

    def _stop(self, reason: str, step: int) -> None:
        self.stopped = reason
        self.history.append({"step": step, "kind": "stopped", "applied": False, "reason": reason})
        self.emit("anomaly", "control_plane", f"actuator stopped: {reason}", severity="error",
                  evidence={"step": step})  # fmt: skip
