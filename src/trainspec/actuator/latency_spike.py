"""Latency spikes: the collective latency probe's window median against its own baseline.

Each rank contributes the median of its probe readings over the window (the latency probe:
a small all-reduce on a side gloo group every sampling interval). Every rank reads the same
value for a probe (the smallest duration over the ranks), so the ranks' medians differ only
by which readings fell into each rank's window, or by a fault injected into one rank's view;
the window's value is the highest median, and a finding names the ranks within 5% of it
("every reporting rank" when that is all of them). The baseline is the median of the last `memory` window values
that were not spikes, so a spike does not raise its own bar. A spike enters when the value
exceeds `factor` x baseline and the baseline by at least `floor_s` (sub-millisecond jitter on
a busy host is not news) for `patience` windows in a row, and clears once the value is back
under the midpoint between the baseline and the spike bar for as many. The patience matters
on CPU-bound ranks: the probe is timed from Python, so a window in which a rank's host was
busy (a store flush holding the interpreter, a neighbour's burst) reads several milliseconds
without any link being slower; seen in a healthy two-rank run here (0.18 -> 5 ms, one window). The median, not the p95, of a window: one probe that met a
scheduler hiccup on a CPU-bound rank moves a p95 of a handful of readings, not a median.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from trainspec.actuator.findings import Finding
from trainspec.actuator.summary import RankSummary
from trainspec.actuator.windowed import Latch

AT_MAX = 0.95  # a rank whose window median is within 5% of the highest is named with it


@dataclass
class LatencySpikeDetector:
    factor: float = 3.0
    floor_s: float = 0.002
    memory: int = 8
    min_baseline: int = 3  # windows of baseline before a spike can be judged
    patience: int = 3
    latch: Latch = field(default_factory=Latch)
    _history: deque[float] = field(default_factory=deque)
    _named: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.factor > 1.0 or not self.floor_s >= 0:
            raise ValueError(
                f"actuator.latency_spike_factor must be > 1 and latency_spike_floor_s >= 0, "
                f"got {self.factor}, {self.floor_s}"
            )
        self.latch.patience = self.patience
        if not 1 <= self.min_baseline <= self.memory:
            raise ValueError(
                f"need 1 <= min_baseline <= memory, got {self.min_baseline}, {self.memory}"
            )

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        values = [
            (s.probe_latency_s, s.rank) for s in summaries if math.isfinite(s.probe_latency_s)
        ]
        if not values:
            return []
        value, _ = max(values)
        # Every rank reads the same probe (the smallest duration over the ranks), so equal
        # medians are the rule: name a rank only where its window stood out.
        worst = tuple(sorted(r for v, r in values if v >= AT_MAX * value))
        rank = worst[0] if len(worst) == 1 else None
        where = (
            f"rank {rank}" if rank is not None
            else "every reporting rank" if len(worst) == len(values)
            else "ranks " + ", ".join(map(str, worst))
        )  # fmt: skip
        if len(self._history) < self.min_baseline:
            self._remember(value)
            return []
        baseline = statistics.median(self._history)
        bar = max(self.factor * baseline, baseline + self.floor_s)
        evidence = {
            "probe_median_s": round(value, 6),
            "baseline_s": round(baseline, 6),
            "ratio": round(value / baseline, 2) if baseline > 0 else None,
            "rank": rank,
            "ranks": list(worst),
        }
        above, below = value > bar, value < (baseline + bar) / 2
        change = self.latch.update(above, below)
        if not self.active and not above:
            self._remember(value)  # a spike, or the windows counting toward one, stay out
        if change is None:
            return []
        if change == "enter":
            self._named = worst  # the clearing names the ranks the spike was found on
            return [
                Finding(
                    "latency_spike",
                    f"collective latency spiked: the probe all-reduce's window median is "
                    f"{value * 1e3:.2f} ms on {where} against its baseline of "
                    f"{baseline * 1e3:.3f} ms (bar {bar * 1e3:.2f} ms) for "
                    f"{self.patience} windows",
                    evidence=evidence,
                    ranks=worst,
                    severity="warning",
                )
            ]
        return [
            Finding(
                "latency_spike",
                f"collective latency back near its baseline: {value * 1e3:.2f} ms against "
                f"{baseline * 1e3:.2f} ms",
                evidence=evidence,
                ranks=self._named or worst,
                cleared=True,
                severity="info",
            )
        ]

    @property
    def active(self) -> bool:
        return self.latch.active

    def _remember(self, value: float) -> None:
        self._history.append(value)
        while len(self._history) > self.memory:
            self._history.popleft()
