"""Each rank's compute time per step as a line in its share: c_r(n) = a_r + b_r * n.

Proportional-to-speed shares (LB-BSP) assume no fixed cost per step. A real step has one
(launches, the optimizer's share of compute, Python), so a rank given fewer samples looks
slower per sample and pure proportional shares overshoot. Once a rank has been measured at
two different shares the line is fitted through one point at each, and the shares that
make every rank finish together solve a_r + b_r n_r = T with sum(n_r) = N:
T = (N + sum(a_r / b_r)) / sum(1 / b_r), n_r = (T - a_r) / b_r. Until then, the per-sample
time stands in (a = 0), and so it does when a fit is not plausible (negative slope or
intercept from noise) or ill-conditioned: two shares closer than `min_spread` of the larger
one (8 and 9 samples, say) turn a few percent of noise into a slope off by a factor.

Each point is the median of the latest `memory` window medians measured at that share, not
one window: on a shared host a neighbour's burst can double one window of one rank, and a
fit through a single window then chases it (seen on the 2-core CI machine: shares moved
[13, 3] -> [10, 6] -> [13, 3] as single windows swung the speed ratio from 4.4x to 1.8x).
A share entered afresh starts a fresh pool, since the move itself says conditions changed.

A rank without a line of its own (one share so far, as after a restart with restored uneven
shares; QA's bug 7) stands at a = 0 (`lines`), and on a small share it then looks slow per
sample (its fixed cost spread over few samples): the balance reproduces the shares it runs at
and the predicted gain of going back stays under the bar, even once every rank is equally
fast. `alike_lines` asks what the split costs if such ranks are alike: when their current
points, at shares at least `min_spread` apart, rise with the share on a plausible line (slope
> 0, 0 <= a below every point; least squares across the ranks), that line's a stands in as
each one's fixed cost, its line through its own point. Equal ranks then balance to equal
shares; ranks that finish together (a slow rank's balanced split) fit no rising line, and the
gain such lines predict is at most the spread of the measured step times, so a split whose
ranks finish together stays put. The rebalance policy decides on that gain but moves only as
far as the a = 0 lines, the worst any line through the measured points can be for a rank given
more samples, predict no slower (rebalance.py): a rank that really is slower keeps a smaller
share, and the move gives each rank a second share for its own line.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
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
    memory: int = 5  # windows pooled per share (odd: a true median)
    min_spread: float = 0.2  # fit only through shares at least this far apart (of the larger)
    # rank -> {samples per step: the latest window medians of compute seconds per step}, in
    # the order the shares were last entered: the current share last, the previous before it
    _points: dict[int, dict[int, deque[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.memory < 1:
            raise ValueError(f"memory must be at least 1 window, got {self.memory}")

    def observe(self, summaries: list[RankSummary]) -> None:
        for s in summaries:
            if s.steps > 0 and s.samples > 0 and s.compute_s > 0:
                n = round(s.samples / s.steps)
                if n <= 0:
                    continue
                points = self._points.setdefault(s.rank, {})
                if n not in points or next(reversed(points)) != n:
                    points.pop(n, None)  # entered afresh: a new pool, last in order
                    points[n] = deque(maxlen=self.memory)
                points[n].append(s.per_sample_s * s.samples / s.steps)  # the median step
                while len(points) > 2:  # keep the current share and the most recent other
                    del points[next(iter(points))]

    def lines(self, summaries: list[RankSummary]) -> list[Line]:
        """Each rank's own line, or where it has none (yet) the line through its point and
        the origin (a = 0): every sample costs the same, the pessimistic guess for a rank that
        gains samples and the optimistic one for a rank that loses them."""
        return [self._own_or(s, 0.0) for s in summaries]

    def alike_lines(self, summaries: list[RankSummary]) -> list[Line] | None:
        """As `lines`, but a rank without a line of its own shares the fixed cost that the
        points of all such ranks fit (`shared_fixed_s`); None when they fit none."""
        alone = [s for s in summaries if self._line(s) is None]
        fixed = self.shared_fixed_s(alone)
        return [self._own_or(s, fixed) for s in summaries] if fixed > 0 else None

    def shared_fixed_s(self, summaries: list[RankSummary], max_share: float = 1.0) -> float:
        """The fixed per-step cost of a line through the current points of `summaries`' ranks
        (least squares); 0.0 unless they span `min_spread` and the line rises with the share
        and cuts the time axis at or above 0 and below every point. At most `max_share` of the
        lowest point (the straggler detector's bound: straggler.py)."""
        points = [p for p in map(self._current, summaries) if p is not None]
        shares = [n for n, _ in points]
        spread = max(shares, default=0) - min(shares, default=0)
        if len(points) < 2 or spread == 0 or spread < self.min_spread * max(shares):
            return 0.0
        mean_n = statistics.fmean(shares)
        mean_c = statistics.fmean(c for _, c in points)
        var = sum((n - mean_n) ** 2 for n in shares)
        slope = sum((n - mean_n) * (c - mean_c) for n, c in points) / var
        fixed = mean_c - slope * mean_n
        lowest = min(c for _, c in points)
        return min(fixed, max_share * lowest) if slope > 0 and 0 <= fixed < lowest else 0.0

    def per_sample_s(self, s: RankSummary) -> float:
        """The pooled per-sample time at this rank's current share (this window's if none)."""
        point = self._current(s)
        return point[1] / point[0] if point is not None else s.per_sample_s

    def _current(self, s: RankSummary) -> tuple[int, float] | None:
        """(samples, pooled compute seconds) per step at this rank's current share."""
        points = self._points.get(s.rank, {})
        if not points:
            return None
        n, pool = next(reversed(points.items()))
        return n, statistics.median(pool)

    def _own_or(self, s: RankSummary, fixed_s: float) -> Line:
        """The rank's own line, else the line through its current point with this fixed cost."""
        own = self._line(s)
        if own is not None:
            return own
        point = self._current(s)
        if point is None:
            return Line(0.0, s.per_sample_s)
        n, c = point
        return Line(fixed_s, (c - fixed_s) / n)

    def _line(self, s: RankSummary) -> Line | None:
        """The rank's own line through two shares, or None where it has none (yet)."""
        points = self._points.get(s.rank, {})
        if len(points) < 2:
            return None
        (n1, c1), (n2, c2) = sorted((n, statistics.median(p)) for n, p in points.items())
        if n2 - n1 < self.min_spread * n2:
            return None
        slope = (c2 - c1) / (n2 - n1)
        fixed = c1 - slope * n1
        return Line(fixed, slope) if slope > 0 and fixed >= 0 else None


def balanced_shares(lines: list[Line], total: int) -> list[float]:
    """Real-valued shares that make every rank's compute equal, summing to `total`."""
    inv = [1.0 / line.per_sample_s for line in lines]
    t = (total + sum(line.fixed_s * i for line, i in zip(lines, inv, strict=True))) / sum(inv)
    return [max(0.0, (t - line.fixed_s) * i) for line, i in zip(lines, inv, strict=True)]


def integer_balanced_shares(lines: list[Line], total: int, min_share: int) -> list[int]:
    """Integer shares summing to `total`, each at least `min_share`, that minimise the slowest
    rank's compute: each sample goes to the rank that would finish it first (optimal for unit
    work on increasing lines, as for unit jobs on related machines), starting one below the
    real-valued balance so it takes at most about one greedy step per rank. Rounding the
    real-valued shares instead can leave a sample where a large fixed cost makes it dearest."""
    if min_share * len(lines) > total:
        raise ValueError(f"min_share {min_share} x {len(lines)} ranks exceeds total {total}")
    start = [max(min_share, math.floor(x) - 1) for x in balanced_shares(lines, total)]
    if sum(start) > total:
        start = [min_share] * len(lines)
    shares = list(start)
    heap = [(line.at(n + 1), r) for r, (line, n) in enumerate(zip(lines, shares, strict=True))]
    heapq.heapify(heap)  # ties go to the lower rank: every rank computes the same plan
    for _ in range(total - sum(shares)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, (lines[r].at(shares[r] + 1), r))
    return shares


def predicted_step_s(shares: list[int], lines: list[Line]) -> float:
    """Compute time of a step under `shares`: the slowest rank's."""
    return max(line.at(n) for n, line in zip(shares, lines, strict=True))
