"""What detectors report and what policies decide: plain records, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    """An anomaly (or its end) a detector raised from one window of summaries."""

    kind: str  # straggler | comm_bound | input_bound | gradient_regime | loss_spike | ...
    reason: str
    ranks: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"
    cleared: bool = False  # True: the condition ended (hysteresis exit)


@dataclass(frozen=True)
class Action:
    """A change every rank applies at the same step boundary (or advice, which changes nothing)."""

    kind: str  # rebalance | compression | checkpoint | memory | advice
    reason: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()

    @property
    def changes_state(self) -> bool:
        return self.kind != "advice"


@dataclass
class Window:
    """One decision's input: every rank's summary and the window's index and last step."""

    index: int
    step: int  # the step index the next plan applies from
    summaries: list[Any]
