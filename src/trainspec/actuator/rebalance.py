"""Rebalancing: per-rank shares of a constant global batch, proportional to measured speed.

After LB-BSP (Chen et al., "Semi-dynamic load balancing", SoCC 2020): give each rank a batch
share proportional to its throughput, so all ranks finish their compute together. Speeds are
1 / per-sample compute time, refined by a per-rank line with a fixed per-step cost once a rank
has run at two shares (speed_model.py). The global batch N stays constant and shares stay integers
(largest remainder), so the sampler's coverage and the hook's n_r / N weighting stay exact.

Against noise and oscillation: leave equal shares only while the straggler detector flags a
rank (a machine whose ranks differ by less than its threshold is healthy, not unbalanced);
act only when the predicted step-time gain of the target over the current shares exceeds
`min_gain` for as many windows as `MoveGate` asks (patience, one quick same-way follow-up
after a move, back-off: move_gate.py); move at most
`max_change` x (N / W) samples per rank per decision; never give a rank fewer than `min_share` samples.

Shares that no measurement explains (restored uneven after a restart with the speed model
fresh, every rank at one share): the gain is also judged on `SpeedModel.alike_lines` (the
ranks without a line of their own sharing the fixed cost their points fit), and where that
gain is the larger the move goes toward its target only as far as `_no_slower` allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainspec.actuator.findings import Action
from trainspec.actuator.move_gate import MoveGate
from trainspec.actuator.speed_model import Line, SpeedModel, integer_balanced_shares
from trainspec.actuator.speed_model import predicted_step_s as line_step_s
from trainspec.actuator.summary import RankSummary
from trainspec.data.sampler import apportion

_SCALE = 1_000_000  # float weights -> integer weights for `apportion`


def _int_weights(weights: list[float]) -> list[int]:
    top = max(weights)
    ints = [max(0, round(_SCALE * w / top)) for w in weights] if top > 0 else []
    return ints if sum(ints) > 0 else [1] * len(weights)


@dataclass
class RebalancePolicy:
    global_batch: int
    world_size: int
    min_gain: float = 0.1
    follow_min_gain: float = 0.03  # the quick same-way follow-up's bar (move_gate.py)
    patience: int = 2
    max_change: float = 0.75
    cooldown: int = 0
    min_share: int = 1
    settle_patience: int = 1
    max_backoff: int = 4
    model: SpeedModel = field(default_factory=SpeedModel)
    gate: MoveGate = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.follow_min_gain <= self.min_gain:
            raise ValueError(
                f"follow_min_gain must be in [0, min_gain={self.min_gain}], "
                f"got {self.follow_min_gain}"
            )
        if not 0 < self.max_change <= 1:
            raise ValueError(f"max_change must be in (0, 1], got {self.max_change}")
        if self.min_share * self.world_size > self.global_batch:
            raise ValueError(
                f"min_share {self.min_share} x {self.world_size} ranks exceeds the global batch"
            )
        self.gate = MoveGate(
            patience=self.patience,
            settle_patience=self.settle_patience,
            max_backoff=self.max_backoff,
            cooldown=self.cooldown,
        )

    def equal_shares(self) -> list[int]:
        return apportion(self.global_batch, [1] * self.world_size)

    def decide(
        self, summaries: list[RankSummary], current: list[int], *, straggling: bool = True
    ) -> Action | None:
        """The next shares, or None. `straggling`: a straggler is flagged now; from equal
        shares nothing moves without one (shares already moved may move back without)."""
        self.model.observe(summaries)
        if not self.gate.open_window():
            return None
        # A window without its own measurement counts as none, not as the pooled past.
        raw = [s.per_sample_s for s in summaries]
        times = [self.model.per_sample_s(s) for s in summaries]
        if not all(math.isfinite(t) and t > 0 for t in raw + times):
            self.gate.reset()
            return None
        lines = self.model.lines(summaries)
        target = self._target(lines)
        now_s, target_s = line_step_s(current, lines), line_step_s(target, lines)
        gain = 1 - target_s / now_s if now_s > 0 else 0.0
        plan = target  # where this move heads: the target, or a safe part of the way
        alike = self.model.alike_lines(summaries)
        if alike is not None:  # ranks without a line of their own lie on one (speed_model.py)
            best = self._target(alike)
            alike_now_s, best_s = line_step_s(current, alike), line_step_s(best, alike)
            if alike_now_s > 0 and 1 - best_s / alike_now_s > gain:
                # What the split costs if those ranks are alike decides whether to move; how
                # far is what no line through the measured points predicts to be slower.
                lines, target, now_s, target_s = alike, best, alike_now_s, best_s
                gain = 1 - target_s / now_s
                plan = self._no_slower(current, target, self.model.lines(summaries))
        new = self._bounded(current, plan)
        move = [b - a for a, b in zip(current, new, strict=True)]
        ready = self.gate.ready(
            gain,
            move,
            min_gain=self.min_gain,
            follow_min_gain=self.follow_min_gain,
            back_off=straggling,
        )
        if not ready:
            return None
        equal = self.equal_shares()
        if not straggling and list(current) == equal:
            return None  # the gain is counted, but equal shares wait for a flagged straggler
        if new == current:
            return None
        self.gate.moved(move, back_to_equal=new == equal, back_off=straggling)
        moved = [r for r, d in enumerate(move) if d]
        return Action(
            "rebalance",
            f"shares follow measured speed: predicted compute per step {now_s * 1e3:.1f} ms -> "
            f"{line_step_s(new, lines) * 1e3:.1f} ms (target {target} would give "
            f"{target_s * 1e3:.1f} ms, {gain:.0%} faster); global batch stays {self.global_batch}",
            before={"shares": list(current)},
            after={"shares": new},
            evidence={
                "per_sample_s": [round(t, 6) for t in times],
                "fixed_s": [round(line.fixed_s, 6) for line in lines],
                "target": target,
                "plan": plan,
                "predicted_gain": round(gain, 4),
                "next_move_needs_windows": self.gate.needed_windows,
            },
            ranks=tuple(moved),
        )

    def _target(self, lines: list[Line]) -> list[int]:
        return integer_balanced_shares(lines, self.global_batch, self.min_share)

    def _bounded(self, current: list[int], target: list[int]) -> list[int]:
        """Move toward `target` by at most `max_change` of an equal share per rank."""
        return self._toward(current, target, self.max_change * self.global_batch / self.world_size)

    def _toward(self, current: list[int], target: list[int], limit: float) -> list[int]:
        """Move toward `target` by at most `limit` (at least 1) samples per rank."""
        limit = max(1.0, limit)
        biggest = max(abs(t - c) for c, t in zip(current, target, strict=True))
        if biggest <= limit:
            return list(target)
        alpha = limit / biggest
        moved = [c + alpha * (t - c) for c, t in zip(current, target, strict=True)]
        # A convex mix of two valid plans: every entry is already >= min_share.
        return apportion(self.global_batch, _int_weights(moved))

    def _no_slower(self, current: list[int], target: list[int], lines: list[Line]) -> list[int]:
        """The furthest plan on the way to `target` that `lines` do not predict slower than
        `current`. With `lines` through each rank's measured point and the origin where it
        has no line of its own, a rank given more samples is costed at its worst (a = 0) and
        one given fewer at no less than now, so no line through those points makes the plan
        slower. On the way the slowest rank only sheds work and the others' cost only grows
        (the largest of lines rising or falling along the way), so bisection finds it."""
        now_s = line_step_s(current, lines) * (1 + 1e-9)
        lo, hi = 0, max(abs(t - c) for c, t in zip(current, target, strict=True))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_step_s(self._toward(current, target, mid), lines) <= now_s:
                lo = mid
            else:
                hi = mid - 1
        return self._toward(current, target, lo) if lo > 0 else list(current)
