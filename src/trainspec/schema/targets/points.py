"""Normalized metric points, and how a list of them becomes validator statistics.

`Point` is the shape both wire formats decode to (OTLP in `otlp.py`, Prometheus text in
`prometheus_text.py`): one data point with its metric's name, unit and kind, its own
attributes and its resource's. The agent reuses it to ingest OTLP from ranks.
"""

from __future__ import annotations

import math
import re
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
RUN_ATTR = "trainspec.run.id"
# What a node measures on its own (a node agent's readings of its GPUs and host): with
# neither a rank nor a run id these are the node's series, not a rank's.
NODE_METRIC_PREFIXES = ("trainspec.gpu.", "trainspec.host.")
# OTLP point kind (+ monotonic) -> catalogue instrument.
# A summary is its own kind (quantiles, no buckets): "is a summary, the catalogue says ...".
_INSTRUMENT = {
    "gauge": "gauge",
    "histogram": "histogram",
    "exponential_histogram": "histogram",
    "summary": "summary",
}


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
    malformed: str | None = None  # why the point breaks its wire format (a histogram's counts)
    misnamed: str | None = None  # why its name breaks the naming rule (a counter's `_total`)

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


_WHOLE = re.compile(r"[+-]?[0-9]+")


def as_int(value: object) -> int | None:
    """`value` as a whole number, or None where it is none: an integer, a float without a
    fraction, or a string of digits (a Prometheus label). A bool, 0.5, NaN, infinity, "1.0"
    or "abc" is no whole number (int() took True for 1, 0.5 for 0, and raised on infinity)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        try:
            return int(value)
        except ValueError:  # more digits than int() converts
            return None
    return None


def is_node_point(p: Point) -> bool:
    """A node's own reading: no rank, no run id, and a metric a node measures (GPU or
    host). A rank's series that lost its rank label keeps its run id, and a rank's own
    metric (steps, process, allocator...) is a rank's whatever labels it lost: both are
    judged as a rank's, rank `?`."""
    return (
        p.attribute(RANK_ATTR) is None
        and p.attribute(RUN_ATTR) is None
        and p.name.startswith(NODE_METRIC_PREFIXES)
    )


def _key_items(attrs: dict[str, object]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in attrs.items()))


def _series_key(p: Point) -> tuple:
    """A series is one metric's points with one attribute set from one resource: two OTLP
    resources (two runs, hosts or processes: every attribute of the resource counts, as in
    the OpenTelemetry data model) are two series even where they claim the same rank. A
    Prometheus series' labels are all point attributes (its resource is empty)."""
    return (p.name, p.rank, _key_items(p.attributes), _key_items(p.resource))


def build_target(
    points: list[Point], catalogue: Catalogue, *, source: str, kind: str, prefix: str
) -> TargetData:
    """Group points into series and summarize them; names under `prefix` that the catalogue
    lacks are reported as unknown, except a component's own (the catalogue's operational
    namespaces: counted in one note); names outside it (other instrumentation) are
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
        fault = UnknownName(p.name, p.rank, p.misnamed) if p.misnamed else None
        if fault and fault not in data.misnamed:
            data.misnamed.append(fault)
        declared = Declared(p.unit, p.instrument, p.found_as or p.name)
        seen = data.declared.setdefault(p.name, [])
        if declared not in seen:
            seen.append(declared)
    if operational:  # every agent's endpoint has them: a note, not a warning for --strict
        data.notes.append(
            f"not judged: {len(operational)} metric(s) of a component's own "
            f"({', '.join(sorted(catalogue.operational_namespaces))}.*), outside the catalogue"
        )
    data.timed = any(p.ts is not None for p in points)
    data.span = "its rank's points from the same resource (first to last time in the target)"
    spans = _spans(groups)
    origins = _origins(groups)
    for key, group in groups.items():
        name, rank = key[0], key[1]
        # A cumulative point's start time says which process's stream it belongs to.
        stream = all(p.temporality == "cumulative" for p in group)
        stats = summarize(
            name,
            rank,
            dict(group[0].attributes),
            [(p.ts, p.scalar) for p in group],
            cumulative=all(p.cumulative for p in group),
            starts=[p.start_ts for p in group] if stream else None,
        )
        stats.origin = origins.get(key, "")
        times = _times(group)
        if times:
            start, end = spans[_span_key(key)]
            stats.head_gap_s, stats.tail_gap_s = min(times) - start, end - max(times)
        bounds = [b for p in group for b in p.bucket_bounds if not math.isnan(b)]
        stats.lowest_bound = min(bounds) if bounds else None
        # A histogram's min and max are values too: NaN or infinite ones break `finite`.
        stats.nonfinite += sum(
            1
            for p in group
            if (p.scalar is None or math.isfinite(p.scalar))
            and any(x is not None and not math.isfinite(x) for x in (p.min, p.max))
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


def _times(group: list[Point]) -> list[float]:
    return [p.ts for p in group if p.ts is not None and math.isfinite(p.ts)]


def _span_key(key: tuple) -> tuple:
    """A series' rank and resource (`_series_key`): whose span it must cover."""
    return key[1], key[3]


def _spans(groups: dict[tuple, list[Point]]) -> dict[tuple, tuple[float, float]]:
    """Per rank and resource, its first and last point's time: the span each of its series
    must cover (a payload or timed exposition says no more of when its run began or ended)."""
    spans: dict[tuple, tuple[float, float]] = {}
    for key, group in groups.items():
        times = _times(group)
        if not times:
            continue
        lo, hi = spans.get(_span_key(key), (math.inf, -math.inf))
        spans[_span_key(key)] = (min(lo, *times), max(hi, *times))
    return spans


def _origins(groups: dict[tuple, list[Point]]) -> dict[tuple, str]:
    """For series that share metric, rank and attributes but not their resource, the
    resource attributes that tell them apart ("trainspec.run.id=run-b, host.name=host-b"),
    so a violation on one of them says which."""
    by_series: dict[tuple, list[tuple]] = {}
    for key in groups:
        by_series.setdefault(key[:3], []).append(key)
    out: dict[tuple, str] = {}
    for keys in by_series.values():
        if len(keys) < 2:
            continue
        resources = [groups[k][0].resource for k in keys]
        names = sorted({n for r in resources for n in r})
        differ = [n for n in names if len({repr(r.get(n)) for r in resources}) > 1]
        for key, resource in zip(keys, resources, strict=True):
            out[key] = ", ".join(f"{n}={resource.get(n)}" for n in differ)
    return out


def _infer_ranks(points: list[Point], catalogue: Catalogue, data: TargetData) -> None:
    """Ranks from `trainspec.rank`; a rank has GPUs when any of its points is a GPU metric.
    A node's own series (`is_node_point`) belong to no rank: a node agent's /metrics with no
    rank behind it is judged as a node, with no rank's requirements."""
    gpu_ranks: set[int | None] = set()
    ranks: set[int | None] = set()
    node = False
    for p in points:
        if p.name not in catalogue.metrics and not p.name.startswith("trainspec."):
            continue
        if catalogue.is_operational(p.found_as or p.name):
            continue  # a component's own (the agent's), not a rank's
        if is_node_point(p):
            node = True
            continue
        ranks.add(p.rank)
        world = as_int(p.attribute(WORLD_SIZE_ATTR))
        if world:
            data.world_size = max(data.world_size, world)
        if p.name.startswith("trainspec.gpu.") or "gpu.index" in p.attributes:
            gpu_ranks.add(p.rank)
    check_world_size(data.world_size, data.source)
    if node and not ranks:
        data.notes.append("no rank: judged as a node's own series (service.name and host.name)")
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
