"""Loss spikes and NaN losses, against a running reference of earlier windows.

A window whose mean loss exceeds `spike_factor` x the reference (an exponential average of
earlier windows' means) is a spike; any non-finite loss on any rank is flagged at once.
Spiking windows do not update the reference, so a run of spikes cannot become the norm.
The rise is measured against the reference's magnitude: a spike is a loss above the
reference by more than (`spike_factor` - 1) x |reference|, which for a positive reference is
`spike_factor` x it, and for a negative loss (a log-likelihood objective, an ELBO) is a rise,
where `loss > spike_factor * reference` flagged every window of one (-2.0 > 1.5 x -2.0). A
reference of exactly 0 has no scale to judge by: no spike against it.

The reference goes into a checkpoint (runtime/checkpoint_episode.py): a job restarted in the
middle of a spike measured it afresh at the high loss and saw no spike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainspec.actuator.findings import Finding
from trainspec.actuator.state_fields import finite_or_none, read_float
from trainspec.actuator.summary import FLAG_NAN_LOSS, RankSummary


@dataclass
class LossSpikeDetector:
    spike_factor: float = 1.5
    decay: float = 0.7
    reference: float = math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"reference": finite_or_none(self.reference)}

    def load_state_dict(self, state: Any) -> None:
        """A missing key keeps the reference; raises StateError naming a bad one."""
        self.reference = read_float(state, "reference", self.reference)

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
        if math.isfinite(ref) and ref != 0 and loss - ref > (self.spike_factor - 1) * abs(ref):
            said = (
                f"is {loss / ref:.1f}x the running reference {ref:.4g} "
                f"(threshold {self.spike_factor}x)"
                if ref > 0
                else f"rose {loss - ref:.4g} above the running reference {ref:.4g}, "
                f"{(loss - ref) / -ref:.0%} of its magnitude (threshold {self.spike_factor - 1:.0%})"
            )
            return [
                Finding(
                    "loss_spike",
                    f"window mean loss {loss:.4g} {said}",
                    evidence={"loss": loss, "reference": ref},
                    severity="error",
                )
            ]
        self.reference = (
            loss if not math.isfinite(ref) else self.decay * ref + (1 - self.decay) * loss
        )
        return []
