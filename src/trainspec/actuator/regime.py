"""Critical gradient regimes, after Accordion (Agarwal et al., MLSys 2021).

Accordion detects a critical regime when the norm of the gradient changes fast between
intervals: |‖g_prev‖ - ‖g_now‖| / ‖g_prev‖ >= eta (eta = 0.5 in the paper). In those regimes
compression hurts final accuracy, so the compression policy stays gentle there. The norm
used is the global gradient norm the hook publishes, identical on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainspec.actuator.findings import Finding
from trainspec.actuator.state_fields import finite_or_none, read_bool, read_float
from trainspec.actuator.summary import RankSummary


@dataclass
class GradientRegimeDetector:
    eta: float = 0.5
    critical: bool = True  # training starts in a critical regime (Accordion's observation)
    _previous: float = math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"critical": self.critical, "previous_grad_norm": finite_or_none(self._previous)}

    def load_state_dict(self, state: Any) -> None:
        """Missing keys keep their value; raises StateError naming a bad one."""
        critical = read_bool(state, "critical", self.critical)
        previous = read_float(state, "previous_grad_norm", self._previous)
        self.critical, self._previous = critical, previous

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        norms = [s.grad_norm for s in summaries if math.isfinite(s.grad_norm)]
        if not norms:
            return []
        now = max(norms)
        previous, self._previous = self._previous, now
        if not math.isfinite(previous) or previous <= 0:
            return []
        change = abs(previous - now) / previous
        critical = change >= self.eta
        if critical == self.critical:
            return []
        self.critical = critical
        word = "entered" if critical else "left"
        return [
            Finding(
                "gradient_regime",
                f"training {word} a critical regime: gradient norm changed {change:.0%} over the "
                f"window (Accordion threshold {self.eta:.0%})",
                evidence={"grad_norm": now, "previous": previous, "relative_change": change},
                severity="info",
                cleared=not critical,
            )
        ]
