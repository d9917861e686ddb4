"""Straggler detection: each rank's per-sample compute time against the fastest rank's.

After NVIDIA's straggler detection (nvidia-resiliency-ext, `straggler` package): every rank
gets a relative performance score, best time over its time, in 0..1; a rank whose score
stays below a threshold is a straggler. Scores use per-sample local compute (forward and
backward less the wait for other ranks), so a rank given fewer samples is not mistaken for
a fast one, and the wait a fast rank spends on a slow one does not count against it.
Hysteresis: a rank enters after `patience` windows below `enter_score` and leaves after
`patience` windows at or above `exit_score`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainspec.actuator.findings import Finding
from trainspec.actuator.summary import RankSummary


def performance_scores(summaries: list[RankSummary]) -> list[float]:
    """Best per-sample time over each rank's (1.0 for the fastest; nan without data)."""
    times = [s.per_sample_s for s in summaries]
    valid = [t for t in times if math.isfinite(t) and t > 0]
    if not valid:
        return [math.nan] * len(times)
    best = min(valid)
    return [best / t if math.isfinite(t) and t > 0 else math.nan for t in times]


@dataclass
class StragglerDetector:
    enter_score: float = 0.8
    exit_score: float = 0.9
    patience: int = 2
    _below: dict[int, int] = field(default_factory=dict)
    _above: dict[int, int] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 < self.enter_score <= self.exit_score <= 1:
            raise ValueError(
                f"need 0 < enter_score <= exit_score <= 1, got {self.enter_score}, {self.exit_score}"
            )
        if self.patience < 1:
            raise ValueError(f"patience must be at least 1, got {self.patience}")

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        scores = performance_scores(summaries)
        findings: list[Finding] = []
        for rank, score in enumerate(scores):
            if not math.isfinite(score):
                continue
            below = self._below[rank] = (
                self._below.get(rank, 0) + 1 if score < self.enter_score else 0
            )
            above = self._above[rank] = (
                self._above.get(rank, 0) + 1 if score >= self.exit_score else 0
            )
            evidence = {
                "score": round(score, 4),
                "scores": [round(s, 4) for s in scores],
                "per_sample_s": [round(s.per_sample_s, 6) for s in summaries],
                "windows": below if rank not in self.flagged else above,
            }
            if rank not in self.flagged and below >= self.patience:
                self.flagged.add(rank)
                findings.append(
                    Finding(
                        "straggler",
                        f"rank {rank} computes a sample {1 / score:.2f}x slower than the fastest "
                        f"rank (score {score:.2f} < {self.enter_score} for {below} windows)",
                        ranks=(rank,),
                        evidence=evidence,
                    )
                )
            elif rank in self.flagged and above >= self.patience:
                self.flagged.discard(rank)
                findings.append(
                    Finding(
                        "straggler",
                        f"rank {rank} recovered (score {score:.2f} >= {self.exit_score} "
                        f"for {above} windows)",
                        ranks=(rank,),
                        evidence=evidence,
                        severity="info",
                        cleared=True,
                    )
                )
        return findings
