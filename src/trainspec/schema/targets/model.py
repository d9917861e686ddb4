"""What every target reader hands the validator: per-series statistics, not raw points.

A run can hold millions of 50 ms samples, so the run reader computes these statistics in
DuckDB; the Prometheus and OTLP readers compute the same statistics in Python from the few
points a payload carries (`summarize`). The validator judges only this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class TargetError(ValueError):
    """A target cannot be read at all: the message is one line naming the target and why."""


@dataclass(frozen=True)
class Declared:
    """What a target says about a metric besides its values (None where it cannot say)."""

    unit: str | None
    instrument: str | None  # gauge | counter | histogram | event, in catalogue terms
    found_as: str  # the name as the target spelled it


@dataclass
class SeriesStats:
    """One series (metric, rank, attribute set) summarized for the rules."""

    metric: str  # catalogue name
    rank: int | None
    attrs: dict[str, object]
    count: int  # points (rows, data points)
    nulls: int = 0  # points without a value (a steps column left empty)
    nonfinite: int = 0  # NaN or infinite values
    minimum: float | None = None  # over finite values
    maximum: float | None = None
    p95_gap_s: float | None = None  # None when fewer than two timed points
    max_gap_s: float | None = None
    cumulative: bool = False  # values must never go down (cumulative counters)
    decreases: int = 0
    largest_drop: float | None = None
    conflicts: int = 0  # extra values at a time the series already has a value for
    untimed: int = 0  # points with no finite time (a stored row whose ts is NULL or NaN)
    attrs_error: str | None = None  # the attributes could not be read
    # Which of several series alike but for their resource (two runs' rank 0 in one OTLP
    # payload): the resource attributes that differ, "" where the series is the only one.
    origin: str = ""
    # Coverage at the edges of its rank's span (`TargetData.span`): how long after the span
    # starts the series' first point comes, and how long before it ends its last one (the
    # largest over a restarted rank's processes; <= 0 where the series reaches the edge).
    head_gap_s: float | None = None
    tail_gap_s: float | None = None
    lowest_bound: float | None = None  # a histogram's lowest finite bucket bound


# The largest world size (and so rank + 1) a target may claim: a label or column of 2e8 had
# the validator build a rank table of that size and run the machine out of memory.
MAX_WORLD_SIZE = 1 << 20


def check_world_size(world_size: int, source: str, *, from_rank: bool = False) -> int:
    """`world_size` (or a highest rank's + 1) if plausible; TargetError naming it otherwise."""
    if world_size > MAX_WORLD_SIZE:
        what = f"rank {world_size - 1}" if from_rank else f"world size {world_size}"
        raise TargetError(
            f"{source}: {what} is not plausible (a world holds at most {MAX_WORLD_SIZE} ranks)"
        )
    return world_size


def rank_outside_world(rank: int, world_size: int) -> str:
    """The `resource-attribute` evidence for a rank its world size does not hold."""
    return f"rank {rank} is not below world size {world_size}"


def is_blank(value: object) -> bool:
    """An attribute value that says nothing (a label set to "", as Prometheus reads one
    not set): it counts as missing."""
    return isinstance(value, str) and not value.strip()


@dataclass(frozen=True)
class RankInfo:
    gpu: bool  # NVML-visible GPUs: `gpu` metrics required
    cuda: bool  # trained on CUDA: `cuda` (allocator) metrics required
    # The rank had a process group: `distributed` metrics required when the world is > 1 (a
    # torchrun worker that made none, `init(create_process_group=False)`, talks to no rank).
    communicates: bool = True


@dataclass(frozen=True)
class EventRecord:
    rank: int | None
    kind: str | None
    name: str | None
    reason: str | None
    evidence: str | None
    before: str | None
    after: str | None


@dataclass(frozen=True)
class UnknownName:
    name: str
    rank: int | None
    evidence: str


@dataclass
class TargetData:
    """Everything a reader found in one target."""

    source: str
    kind: str  # run | prometheus | otlp
    series: list[SeriesStats] = field(default_factory=list)
    ranks: dict[int | None, RankInfo] = field(default_factory=dict)
    world_size: int = 1
    declared: dict[str, list[Declared]] = field(default_factory=dict)  # catalogue name -> ...
    resource_missing: list[tuple[int | None, str]] = field(default_factory=list)
    resource_invalid: list[tuple[int | None, str]] = field(default_factory=list)  # evidence
    unknown: list[UnknownName] = field(default_factory=list)
    # Catalogue metrics spelled against the naming rule (a counter without `_total`).
    misnamed: list[UnknownName] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # `--strict` fails on these
    # What any target of its kind says (a snapshot's cadence is not judged, an agent's own
    # metrics are not): printed, never failing `--strict`.
    notes: list[str] = field(default_factory=list)
    timed: bool = True  # False for a snapshot whose points carry no times (cadence not judged)
    # OTLP: the exporter's interval, as the points' collection times show it. An SDK exports
    # one point per series per interval, so no series' gaps can be shorter: cadence is
    # judged against the longer of it and the catalogue's interval.
    export_interval_s: float | None = None
    # How many gaps between collection times it is inferred from: from one (two exports),
    # a late export cannot be told from the interval, and cadence is not judged above it.
    export_gaps: int = 0
    # What a series' coverage is measured against (`SeriesStats.head_gap_s`), for the report.
    span: str = "its rank's points"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (DuckDB's quantile_cont), so every reader agrees."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    metric: str,
    rank: int | None,
    attrs: dict[str, object],
    points: list[tuple[float | None, float | None]],
    *,
    cumulative: bool,
    starts: list[float | None] | None = None,
) -> SeriesStats:
    """Statistics of one series from its (time, value) points.

    `starts` are the points' start times where they have them (OTLP cumulative points): a
    point whose start time is another one, at or after the previous point's time, begins a
    restarted process's stream, so the step to it is neither a gap nor a counter going down
    (a stored run's restart is judged per process the same way, `store/target.py`). A time
    that is not finite is no time: such a point counts as untimed."""
    stats = SeriesStats(metric, rank, attrs, count=len(points), cumulative=cumulative)
    finite = [v for _, v in points if v is not None and math.isfinite(v)]
    stats.nulls = sum(1 for _, v in points if v is None)
    stats.nonfinite = sum(1 for _, v in points if v is not None and not math.isfinite(v))
    stats.untimed = sum(1 for t, _ in points if t is not None and not math.isfinite(t))
    if finite:
        stats.minimum, stats.maximum = min(finite), max(finite)
    begins = starts if starts is not None else [None] * len(points)
    # By time alone, stable: points of one time keep their arrival order, so a counter sent
    # as 10 then 3 at one time still reads as going down.
    timed = sorted(
        ((t, v, s) for (t, v), s in zip(points, begins, strict=True)
         if t is not None and math.isfinite(t)),
        key=lambda p: p[0],
    )  # fmt: skip
    steps = [(a, b) for a, b in zip(timed, timed[1:]) if not _restart(a, b)]
    stats.conflicts = _conflicts(points)
    gaps = [b[0] - a[0] for a, b in steps]
    if gaps:
        stats.p95_gap_s = percentile(gaps, 0.95)
        stats.max_gap_s = max(gaps)
    if cumulative:
        drops = [
            b[1] - a[1] for a, b in steps if a[1] is not None and b[1] is not None and b[1] < a[1]
        ]
        stats.decreases = len(drops)
        stats.largest_drop = min(drops) if drops else None
    return stats


def _restart(a: tuple, b: tuple) -> bool:
    """Whether timed point `b` (time, value, start) begins a new stream after `a`: another
    start time, at or after `a`'s time. One that moved but overlaps `a` is no restart."""
    return a[2] is not None and b[2] is not None and b[2] != a[2] and b[2] >= a[0]


def _conflicts(points: list[tuple[float | None, float | None]]) -> int:
    """How many more distinct values a series has at its times than one each (a series
    repeated with another value in one exposition, or twice at one time in a payload)."""
    at: dict[float | None, set[object]] = {}
    for t, v in points:
        at.setdefault(t, set()).add("nan" if v is not None and math.isnan(v) else v)
    return sum(len(values) - 1 for values in at.values())
