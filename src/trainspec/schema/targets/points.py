"""Normalized metric points, and how a list of them becomes validator statistics.

`Point` is the shape both wire formats decode to (OTLP in `otlp.py`, Prometheus text in
`prometheus_text.py`): one data point with its metric's name, unit and kind, its own
attributes and its resource's. The agent reuses it to ingest OTLP from ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainspec.schema.catalogue import Catalogue
from trainspec.schema.targets.model import (
    Declared,
    RankInfo,
    TargetData,
    UnknownName,
    check_world_size,
    summarize,
)

RANK_ATTR = "trainspec.rank"
WORLD_SIZE_ATTR = "trainspec.world_size"
# OTLP point kind (+ monotonic) -> catalogue instrument.
_INSTRUMENT = {"gauge": "gauge", "histogram": "histogram", "exponential_histogram": "histogram"}


@dataclass(frozen=True)
class Point:
    """One data point. Times are unix seconds (None when the source gave none)."""

    name: str
    unit: str | None
    kind: str  # gauge | sum | histogram | exponential_histogram | summary | unknown
    ts: float | None
    value: float | None = None  # gauge and sum points
    attributes: dict[str, object] = field(default_factory=dict)
    resource: dict[str, object] = field(default_factory=dict)
    monotonic: bool | None = None  # sums only
    temporality: str | None = None  # cumulative | delta, sums and histograms
    start_ts: float | None = None
    count: int | None = None  # histogram and summary points
    sum: float | None = None
    min: float | None = None
    max: float | None = None
    bucket_bounds: tuple[float, ...] = ()
    bucket_counts: tuple[int, ...] = ()
    scope: str = ""
    found_as: str = ""  # the name as the source spelled it, when it differs from `name`

    def attribute(self, key: str) -> object | None:
        """A point attribute, falling back to the resource's."""
        return self.attributes.get(key, self.resource.get(key))

    @property
    def rank(self) -> int | None:
        return as_int(self.attribute(RANK_ATTR))

    @property
    def instrument(self) -> str | None:
        """The catalogue instrument this point's kind stands for."""
        if self.kind == "sum":
            return "counter" if self.monotonic else "gauge"
        return _INSTRUMENT.get(self.kind)

    @property
    def cumulative(self) -> bool:
        return self.kind == "sum" and bool(self.monotonic) and self.temporality == "cumulative"

    @property
    def scalar(self) -> float | None:
        """The value the range rules judge: a sum's or gauge's value, a histogram's mean."""
        if self.value is not None:
            return self.value
        if self.sum is not None and self.count:
            return self.sum / self.count
        if self.sum is not None and not math.isfinite(self.sum):
            return self.sum
        return None


def as_int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _series_key(p: Point) -> tuple:
    return (p.name, p.rank, tuple(sorted((k, str(v)) for k, v in p.attributes.items())))


def build_target(
    points: list[Point], catalogue: Catalogue, *, source: str, kind: str, prefix: str
) -> TargetData:
    """Group points into series and summarize them; names under `prefix` that the catalogue
    lacks are reported as unknown, except a component's own (the catalogue's operational
    namespaces: counted in one warning); names outside it (other instrumentation) are
    ignored."""
    data = TargetData(source=source, kind=kind)
    groups: dict[tuple, list[Point]] = {}
    operational: set[str] = set()
    for p in points:
        if p.name not in catalogue.metrics:
            found = p.found_as or p.name
            if catalogue.is_operational(found):
                operational.add(found)
            elif found.startswith(prefix):
                data.unknown.append(UnknownName(found, p.rank, f"{p.kind} point"))
            continue
        groups.setdefault(_series_key(p), []).append(p)
        declared = Declared(p.unit, p.instrument, p.found_as or p.name)
        seen = data.declared.setdefault(p.name, [])
        if declared not in seen:
            seen.append(declared)
    if operational:
        data.warnings.append(
            f"not judged: {len(operational)} metric(s) of a component's own "
            f"({', '.join(sorted(catalogue.operational_namespaces))}.*), outside the catalogue"
        )
    data.timed = any(p.ts is not None for p in points)
    for (name, rank, _), group in groups.items():
        stats = summarize(
            name,
            rank,
            dict(group[0].attributes),
            [(p.ts, p.scalar) for p in group],
            cumulative=all(p.cumulative for p in group),
        )
        lows = [p.min for p in group if p.min is not None and math.isfinite(p.min)]
        highs = [p.max for p in group if p.max is not None and math.isfinite(p.max)]
        if lows:
            stats.minimum = min([*lows] + ([stats.minimum] if stats.minimum is not None else []))
        if highs:
            stats.maximum = max([*highs] + ([stats.maximum] if stats.maximum is not None else []))
        data.series.append(stats)
    _infer_ranks(points, catalogue, data)
    return data


def _infer_ranks(points: list[Point], catalogue: Catalogue, data: TargetData) -> None:
    """Ranks from `trainspec.rank`; a rank has GPUs when any of its points is a GPU metric."""
    gpu_ranks: set[int | None] = set()
    ranks: set[int | None] = set()
    for p in points:
        if p.name not in catalogue.metrics and not p.name.startswith("trainspec."):
            continue
        ranks.add(p.rank)
        world = as_int(p.attribute(WORLD_SIZE_ATTR))
        if world:
            data.world_size = max(data.world_size, world)
        if p.name.startswith("trainspec.gpu.") or "gpu.index" in p.attributes:
            gpu_ranks.add(p.rank)
    check_world_size(data.world_size, data.source)
    known = {r for r in ranks if r is not None}
    if known:
        ranks.discard(None)
        data.world_size = max(data.world_size, max(known) + 1)
        check_world_size(data.world_size, data.source, from_rank=True)
        # One rank's endpoint or export speaks for that rank alone; a payload that carries
        # several ranks (a node agent's) must carry all of them.
        if len(known) > 1:
            ranks |= set(range(data.world_size))
    # A payload cannot tell NVML-visible GPUs from CUDA training: where GPUs report, both the
    # GPU and the allocator metrics are expected.
    any_gpu = bool(gpu_ranks)
    for r in sorted(ranks, key=lambda r: -1 if r is None else r):
        has_gpu = r in gpu_ranks or (r not in known and any_gpu)
        data.ranks[r] = RankInfo(gpu=has_gpu, cuda=has_gpu)
