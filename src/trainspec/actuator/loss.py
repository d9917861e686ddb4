"""Loss spikes and NaN losses, against a running reference of earlier windows.

A window whose mean loss exceeds `spike_factor` x the reference (an exponential average of
earlier windows' means) is a spike; any non-finite loss on any rank is flagged at once.
Spiking windows do not update the reference, so a run of spikes cannot become the norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainspec.actuator.findings import Finding
from trainspec.actuator.summary import FLAG_NAN_LOSS, RankSummary


@dataclass
class LossSpikeDetector:
    spike_factor: float = 1.5
    decay: float = 0.7
    reference: float = math.nan

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        nan_ranks = tuple(s.rank for s in summaries if s.flags & FLAG_NAN_LOSS)
        if nan_ranks:
            return [
                Finding(
                    "loss_nan",
                    f"non-finite loss on rank(s) {list(nan_ranks)}",
                    ranks=nan_ranks,
                    severity="error",
                )
            ]
        means = [s.loss_mean for s in summaries if math.isfinite(s.loss_mean)]
        if not means:
            return []
        loss = sum(means) / len(means)
        ref = self.reference
        if math.isfinite(ref) and loss > self.spike_factor * ref:
            return [
                Finding(
                    "loss_spike",
                    f"window mean loss {loss:.4g} is {loss / ref:.1f}x the running reference "
                    f"{ref:.4g} (threshold {self.spike_factor}x)",
                    evidence={"loss": loss, "reference": ref},
                    severity="error",
                )
            ]
        self.reference = (
            loss if not math.isfinite(ref) else self.decay * ref + (1 - self.decay) * loss
        )
        return []
