"""Each rank's compute time per step as a line in its share: c_r(n) = a_r + b_r * n.

Proportional-to-speed shares (LB-BSP) assume no fixed cost per step. A real step has one
(launches, the optimizer's share of compute, Python), so a rank given fewer samples looks
slower per sample and pure proportional shares overshoot. Once a rank has been measured at
two different shares the line is fitted from the latest point at each, and the shares that
make every rank finish together solve a_r + b_r n_r = T with sum(n_r) = N:
T = (N + sum(a_r / b_r)) / sum(1 / b_r), n_r = (T - a_r) / b_r. Until then (or when a fit is
not plausible: negative slope or intercept from noise), the per-sample time stands in (a = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainspec.actuator.summary import RankSummary


@dataclass
class Line:
    fixed_s: float  # a: per-step cost independent of the share
    per_sample_s: float  # b

    def at(self, samples: float) -> float:
        return self.fixed_s + self.per_sample_s * samples


@dataclass
class SpeedModel:
    # rank -> {samples per step: compute seconds per step}, the latest window at each share
    _points: dict[int, dict[int, float]] = field(default_factory=dict)

    def observe(self, summaries: list[RankSummary]) -> None:
        for s in summaries:
            if s.steps > 0 and s.samples > 0 and s.compute_s > 0:
                n = round(s.samples / s.steps)
                points = self._points.setdefault(s.rank, {})
                points[n] = s.per_sample_s * s.samples / s.steps  # the median step
                if len(points) > 2:  # keep the current share and the most recent other one
                    del points[next(k for k in points if k != n)]

    def lines(self, summaries: list[RankSummary]) -> list[Line]:
        return [self._line(s) for s in summaries]

    def _line(self, s: RankSummary) -> Line:
        fallback = Line(0.0, s.per_sample_s)
        points = self._points.get(s.rank, {})
        if len(points) < 2:
            return fallback
        (n1, c1), (n2, c2) = sorted(points.items())
        slope = (c2 - c1) / (n2 - n1)
        fixed = c1 - slope * n1
        return Line(fixed, slope) if slope > 0 and fixed >= 0 else fallback


def balanced_shares(lines: list[Line], total: int) -> list[float]:
    """Real-valued shares that make every rank's compute equal, summing to `total`."""
    inv = [1.0 / line.per_sample_s for line in lines]
    t = (total + sum(line.fixed_s * i for line, i in zip(lines, inv, strict=True))) / sum(inv)
    return [max(0.0, (t - line.fixed_s) * i) for line, i in zip(lines, inv, strict=True)]


def predicted_step_s(shares: list[int], lines: list[Line]) -> float:
    """Compute time of a step under `shares`: the slowest rank's."""
    return max(line.at(n) for n, line in zip(shares, lines, strict=True))
