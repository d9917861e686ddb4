"""Straggler detection: each rank's per-sample compute time against the fastest rank's.

After NVIDIA's straggler detection (nvidia-resiliency-ext, `straggler` package): every rank
gets a relative performance score, best time over its time, in 0..1; a rank whose score
stays below a threshold is a straggler. Scores use per-sample local compute (forward and
backward less the wait for other ranks), so a rank given fewer samples is not mistaken for
a fast one, and the wait a fast rank spends on a slow one does not count against it.

A step also has a fixed cost that does not scale with the share (launches, Python): on uneven
shares (restored from a checkpoint, or after a rebalance) it made a rank on a small share look
slower per sample on equally fast hardware (15 ms + 2 ms a sample: 3.5 ms a sample on 10
samples against 2.7 ms on 22, score 0.77, a finding until the shares evened out). So each
rank's time is its window's median step less a fixed cost, over its samples per step
(`sample_times`). The fixed cost is the one the ranks' current points fit on one line
(`SpeedModel.shared_fixed_s`; the detector's own model: pooled window medians at each rank's
share); none, the plain per-sample time, where they fit none (equal shares; a large share
slower per sample than any line with a fixed cost >= 0 allows). It is at most
`max_fixed_share` of the quickest point's step: ranks that finish together on uneven shares,
as a slow rank does on the small share a rebalance gave it, fit a line too, with a fixed cost
of nearly a whole step, and taking all of that out would pass the slow rank for an equal one
(with half a step out its score stays near the plain one). `max_fixed_share=0` is the plain
score.
Hysteresis: a rank enters after `patience` windows below `enter_score` and leaves after
`patience` windows at or above `exit_score`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainspec.actuator.findings import Finding
from trainspec.actuator.speed_model import SpeedModel
from trainspec.actuator.summary import RankSummary


def sample_times(summaries: list[RankSummary], fixed_s: float = 0.0) -> list[float]:
    """Each rank's per-sample compute with `fixed_s` taken out of its median step: (step -
    fixed_s) / samples per step (nan without data). The plain per-sample times where that
    leaves a rank none: a fixed cost no smaller than a step is no estimate of one."""
    plain = [s.per_sample_s for s in summaries]
    if fixed_s <= 0:
        return plain
    less = [t - fixed_s * s.steps / s.samples if math.isfinite(t) else t
            for t, s in zip(plain, summaries, strict=True)]  # fmt: skip
    return less if all(t > 0 for t in less if math.isfinite(t)) else plain


def relative_scores(times: list[float]) -> list[float]:
    """Best time over each rank's (1.0 for the fastest; nan without data)."""
    valid = [t for t in times if math.isfinite(t) and t > 0]
    if not valid:
        return [math.nan] * len(times)
    best = min(valid)
    return [best / t if math.isfinite(t) and t > 0 else math.nan for t in times]


def performance_scores(summaries: list[RankSummary], fixed_s: float = 0.0) -> list[float]:
    """Best per-sample time over each rank's, `fixed_s` per step taken out (`sample_times`)."""
    return relative_scores(sample_times(summaries, fixed_s))


@dataclass
class StragglerDetector:
    enter_score: float = 0.8
    exit_score: float = 0.9
    patience: int = 2
    max_fixed_share: float = 0.5  # of the quickest point's step, the most taken out as fixed
    model: SpeedModel = field(default_factory=SpeedModel)  # the detector's own: it observes
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
        if not 0 <= self.max_fixed_share < 1:
            raise ValueError(f"max_fixed_share must be in [0, 1), got {self.max_fixed_share}")

    def fixed_s(self, summaries: list[RankSummary]) -> float:
        """The fixed per-step cost taken out of every rank's step (0.0: none), from the
        current points of the ranks measured in this window."""
        measured = [s for s in summaries if math.isfinite(s.per_sample_s) and s.per_sample_s > 0]
        return self.model.shared_fixed_s(measured, max_share=self.max_fixed_share)

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        self.model.observe(summaries)
        fixed = self.fixed_s(summaries)
        times = sample_times(summaries, fixed)
        scores = relative_scores(times)
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
                "fixed_s": round(fixed, 6),
                "per_sample_less_fixed_s": [round(t, 6) for t in times],
                "windows": below if rank not in self.flagged else above,
            }
            if rank not in self.flagged and below >= self.patience:
                self.flagged.add(rank)
                findings.append(
                    Finding(
                        "straggler",
                        f"rank {rank} computes a sample {1 / score:.2f}x slower than the fastest "
                        f"rank (score {score:.2f} < {self.enter_score} for {below} windows"
                        f"{_fixed_note(fixed)})",
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
                        f"for {above} windows{_fixed_note(fixed)})",
                        ranks=(rank,),
                        evidence=evidence,
                        severity="info",
                        cleared=True,
                    )
                )
        return findings


def _fixed_note(fixed_s: float) -> str:
    return f"; {fixed_s * 1e3:.1f} ms fixed per-step cost taken out" if fixed_s > 0 else ""
