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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainspec.actuator.findings import Action
from trainspec.actuator.micro_batch import WHOLE_SHARE, accumulation_steps, effective, halved
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
    ) -> Action | None:
        """`entered`: the detector entered pressure this window; `active`: it is in pressure;
        `pressed`: this window's raw reading was above the threshold; `ranks`: where."""
        self._since_change += 1
        self._clear = 0 if active else self._clear + 1
        limits = [int(s.micro_batch) for s in summaries]
        shares = [int(s.share) for s in summaries]
        largest = max(shares) if shares else 0
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
            lower = halved(current, largest, self.minimum)
            if lower != current:
                target = lower
                why.append("memory pressure: halve the micro-batch, more accumulation steps")
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
        }
        reason = "; ".join(why) + f" (global batch and shares unchanged: {shares})"
        return Action(
            "memory",
            reason,
            before=_plan(current, shares, limits),
            after=_plan(target, shares, [target] * len(shares)),
            evidence=evidence,
            ranks=ranks,
        )

    def _grown(self, current: int, largest: int) -> int:
        if current == WHOLE_SHARE or current == self.configured:
            return current
        doubled = current * 2
        cap = self.configured if self.configured != WHOLE_SHARE else largest
        new = min(doubled, cap) if cap > 0 else doubled
        if self._ceiling and effective(new, largest) >= self._ceiling:
            return current  # never back to a size that ran out of memory
        if self.configured == WHOLE_SHARE and new >= largest:
            return WHOLE_SHARE
        return new


def _plan(limit: int, shares: list[int], limits: list[int]) -> dict[str, object]:
    return {
        "limit": limit,
        "micro_batch": [effective(m, n) for m, n in zip(limits, shares, strict=True)],
        "accumulation_steps": [
            accumulation_steps(n, m) for m, n in zip(limits, shares, strict=True)
        ],
    }
