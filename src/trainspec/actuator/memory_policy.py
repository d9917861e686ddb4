"""The memory action: shrink the micro-batch under pressure, grow it back once pressure is gone.

Multiplicative decrease and cautious increase, as in TCP's congestion control (Jacobson,
"Congestion avoidance and control", SIGCOMM 1988): halve the micro-batch when the memory
detector enters pressure (and again every `patience + cooldown` windows while pressure
persists), double it back only after pressure has been clear for `patience` windows (the
detector's exit) plus `cooldown` more, never above the configured size and never to a size
that has raised an out-of-memory error in this run. The global batch and every rank's share
are untouched: only the number of accumulation steps changes.

Reconcile: an OOM retry halves one rank's micro-batch on its own (runtime/accumulate.py). The
summaries carry each rank's limit, so at the next window every rank sees the difference and
adopts the smallest, the same decision on every rank.

Shares: a rebalance at the same boundary changes them. What is halved is the largest
micro-batch that ran in the window under pressure (on the shares the summaries carry: the
memory was measured there); the plan recorded and every growth back are on the shares in
effect after the boundary (`decide(..., shares=)`), so the event says what the ranks run.

Ceiling: once a micro-batch has run out of memory on any rank, the limit stays a number below
it: the whole share is never granted again, since a later rebalance may grow a share past
the size that failed (MicroBatchPlan.split caps each rank by its own `oom_at` as well).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainspec.actuator.findings import Action
from trainspec.actuator.micro_batch import (
    WHOLE_SHARE,
    accumulation_steps,
    largest_micro_batch,
)
from trainspec.actuator.state_fields import read_count
from trainspec.actuator.summary import RankSummary

_NEVER = 1 << 30


def smallest_limit(limits: list[int]) -> int:
    """The tightest limit (0, the whole share, is the loosest)."""
    bounded = [m for m in limits if m != WHOLE_SHARE]
    return min(bounded) if bounded else WHOLE_SHARE


@dataclass
class MemoryPolicy:
    configured: int = WHOLE_SHARE
    minimum: int = 1
    patience: int = 3
    cooldown: int = 2
    _since_change: int = _NEVER  # windows since the last change this policy decided
    _clear: int = 0  # windows in a row with the detector out of pressure
    _ceiling: int = 0  # smallest micro-batch that raised an OOM on any rank (0: none)

    def __post_init__(self) -> None:
        if self.cooldown < 0:
            raise ValueError(f"actuator.memory_cooldown must be at least 0, got {self.cooldown}")

    def state_dict(self) -> dict[str, Any]:
        return {"since_change": self._since_change, "clear": self._clear, "ceiling": self._ceiling}

    def load_state_dict(self, state: Any) -> None:
        """Missing keys keep their value; raises StateError naming a bad one."""
        since = read_count(state, "since_change", self._since_change)
        clear = read_count(state, "clear", self._clear)
        ceiling = read_count(state, "ceiling", self._ceiling)
        self._since_change, self._clear, self._ceiling = since, clear, ceiling

    def decide(
        self,
        summaries: list[RankSummary],
        *,
        entered: bool,
        active: bool,
        pressed: bool,
        ranks: tuple[int, ...] = (),
        shares: Sequence[int] | None = None,
    ) -> Action | None:
        """`entered`: the detector entered pressure this window; `active`: it is in pressure;
        `pressed`: this window's raw reading was above the threshold; `ranks`: where;
        `shares`: the shares every rank runs from this boundary on (a rebalance decided at
        it), by default the summaries' own."""
        self._since_change += 1
        self._clear = 0 if active else self._clear + 1
        limits = [int(s.micro_batch) for s in summaries]
        ran = [int(s.share) for s in summaries]  # the shares the window ran
        after = [int(n) for n in shares] if shares is not None else ran
        largest = max(after) if after else 0
        ooms = [int(s.oom_micro_batch) for s in summaries if s.oom_micro_batch > 0]
        if ooms:
            self._ceiling = min([*ooms, self._ceiling] if self._ceiling else ooms)
        current = smallest_limit(limits)
        target, why = current, []
        if len(set(limits)) > 1:
            shrunk = [s.rank for s in summaries if s.micro_batch == current]
            why.append(f"rank {shrunk} shrank after an out-of-memory retry: every rank adopts it")
        again = active and pressed and self._since_change >= self.patience + self.cooldown
        if entered or again:
            # Half the largest micro-batch that ran under this pressure, not the limit (an
            # even split runs 6 as 3 + 3 under a limit of 4) nor a share it has not run yet.
            peak = max(
                (largest_micro_batch(n, m) for n, m in zip(ran, limits, strict=True)), default=0
            )
            # Rounded up: still below it from 2 on, and 3 goes to 2, not 1 (6 as 2 + 2 + 2,
            # not six passes of 1).
            lower = max(self.minimum, (peak + 1) // 2)
            if current != WHOLE_SHARE:
                lower = min(lower, current)  # a rank's own limit may already be below it
            if peak > self.minimum and lower != current:
                target = lower
                why.append(
                    f"memory pressure at micro-batch {peak}: halve it, more accumulation steps"
                )
        elif not active and self._clear > self.cooldown and self._since_change > self.cooldown:
            higher = self._grown(current, largest)
            if higher != current:
                target = higher
                why.append(f"pressure clear for {self.patience}+{self.cooldown} windows: grow back")
        if not why:
            return None
        self._since_change = 0
        evidence = {
            "pressure": [round(s.memory_pressure, 4) for s in summaries],
            "limits": limits,
            "oom_micro_batch": [int(s.oom_micro_batch) for s in summaries],
            "shares": after,
        }
        if after != ran:
            evidence["shares_before"] = ran
            reason = "; ".join(why) + (
                f" (global batch unchanged; planned on the shares {after} this boundary's "
                f"rebalance set, was {ran})"
            )
        else:
            reason = "; ".join(why) + f" (global batch and shares unchanged: {after})"
        return Action(
            "memory",
            reason,
            before=_plan(current, ran, limits),
            after=_plan(target, after, [target] * len(after)),
            evidence=evidence,
            ranks=ranks,
        )

    def _grown(self, current: int, largest: int) -> int:
        """Double `current`, never above the configured size (the largest share when that is
        the whole share), never to the OOM ceiling; with a ceiling, never the whole share."""
        if current == WHOLE_SHARE or current == self.configured:
            return current
        doubled = current * 2
        cap = self.configured if self.configured != WHOLE_SHARE else largest
        new = min(doubled, cap) if cap > 0 else doubled
        if self._ceiling and new >= self._ceiling:
            return current  # never back to a size that ran out of memory
        if self.configured == WHOLE_SHARE and new >= largest and not self._ceiling:
            return WHOLE_SHARE
        return new


def _plan(limit: int, shares: list[int], limits: list[int]) -> dict[str, object]:
    """Per rank: the largest micro-batch it runs (the split is even: 11 under a limit of 4 is
    4 + 4 + 3, 5 is 3 + 2) and how many."""
    return {
        "limit": limit,
        "micro_batch": [largest_micro_batch(n, m) for m, n in zip(limits, shares, strict=True)],
        "accumulation_steps": [
            accumulation_steps(n, m) for m, n in zip(limits, shares, strict=True)
        ],
    }
