"""OTLP points as /metrics sources: one per (run, rank), and never the node's own.

OTLP points are aggregates: they feed /metrics only for sources that send no raw batches
(those already feed it exactly), and never the raw store. Gauges and cumulative sums of
catalogue metrics are kept (a delta sum would be read as a running total). The run and rank
are read from the resource, else from each point's attributes (the resource's win: a point
may not relabel them), and go into the source's labels wherever they were given: as point
attributes they were dropped (resource labels are no point's), and ranks 0 and 1 exported
identical series (found 2026-11-27). A sender with neither has a source per resource,
never `NODE`: one arriving before the node sampler's first flush had claimed it, and the
node's series then carried its resource.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

import pyarrow as pa

from trainspec.agent.exposition import SourceKey
from trainspec.collector.records import Batch, attrs_json
from trainspec.schema import Catalogue
from trainspec.schema.targets.points import as_int
from trainspec.store.tables import SAMPLES

RUN_ATTR, RANK_ATTR = "trainspec.run.id", "trainspec.rank"
ANONYMOUS_RANK = -2  # the rank of a source with neither run nor rank (NODE's is -1)


def otlp_sources(
    points: list[Any], catalogue: Catalogue, arrow_sources: Collection[SourceKey]
) -> list[tuple[SourceKey, dict[str, Any], Batch]]:
    """(source, its resource, its samples) for each source the points hold, except those
    in `arrow_sources` (they send raw batches)."""
    by_source: dict[SourceKey, tuple[dict[str, Any], list]] = {}
    for p in points:
        if p.kind not in ("gauge", "sum") or p.value is None:
            continue
        if p.name not in catalogue.metrics or p.temporality == "delta":
            continue
        run = p.resource.get(RUN_ATTR, p.attributes.get(RUN_ATTR))
        run = "" if run is None else str(run)
        rank = as_int(p.resource.get(RANK_ATTR))
        rank = rank if rank is not None else p.rank if p.rank is not None else -1
        if (run, rank) in arrow_sources:
            continue
        resource = dict(p.resource)
        if run:
            resource[RUN_ATTR] = run
        if rank >= 0:
            resource[RANK_ATTR] = rank
        key = (run, rank) if run or rank >= 0 else anonymous_key(resource)
        entry = by_source.setdefault(key, (resource, []))
        entry[1].append((p.ts or time.time(), rank, p.name, p.value, attrs_json(p.attributes)))
    out = []
    for key, (resource, rows) in by_source.items():
        cols = list(zip(*rows))
        table = pa.Table.from_arrays(
            [pa.array(c, f.type) for c, f in zip(cols, SAMPLES)], schema=SAMPLES
        )
        out.append((key, resource, Batch(table, [], [])))
    return out


def anonymous_key(resource: dict[str, Any]) -> SourceKey:
    """The source of a sender that gave no run and no rank: one per resource."""
    return json.dumps(resource, sort_keys=True, default=str), ANONYMOUS_RANK
