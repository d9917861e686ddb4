"""The resource attributes of a Prometheus or OTLP target's series: present, and the counts
among them (rank, local rank, world size) integers in range and one world size per run.

A stored run's ranks and world size come from its runs rows instead (`store/target.py`,
which reuses `count_fault` for their evidence).
"""

from __future__ import annotations

import math
import re

from trainspec.schema.catalogue import Catalogue
from trainspec.schema.targets.model import TargetData, is_blank, rank_outside_world
from trainspec.schema.targets.points import (
    RANK_ATTR,
    RUN_ATTR,
    WORLD_SIZE_ATTR,
    Point,
    as_int,
    is_node_point,
)

LOCAL_RANK_ATTR = "trainspec.local_rank"
# Resource attributes that are counts, and the least each may be: ranks count from 0, and a
# world holds at least one rank.
COUNTS = {RANK_ATTR: 0, LOCAL_RANK_ATTR: 0, WORLD_SIZE_ATTR: 1}
_LEAST_WHY = {0: "counts from 0", 1: "holds at least one rank"}
# A node's own series (a node agent's readings of its GPUs and host: no run, no rank) carry
# the node's attributes only.
NODE_ATTRIBUTES = ("service.name", "host.name")
# An integer as a label or string attribute writes it: plain decimal digits, no sign but a
# minus, no padding ("+1", " 1", "01" and "1.0" are another producer's mistake).
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_SHOWN = 40  # characters of a bad value shown in a violation


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def count_fault(attr: str, value: object, least: int) -> str | None:
    """Why `value` is no valid `attr` (a rank, local rank or world size), in one line naming
    what is wrong with it; None where it is an integer of at least `least`."""
    shown = _shown(value)
    if isinstance(value, bool):
        return f"{attr} is {shown}, a bool, not an integer"
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{attr} is {shown}, not finite, not an integer"
        kind = "a double" if value.is_integer() else "a fraction"
        return f"{attr} is {shown}, {kind}, not an integer"
    if isinstance(value, str):
        if not _INTEGER.fullmatch(value):
            return f"{attr} is {shown}, not an integer in plain decimal digits"
        number = as_int(value)
        if number is None:
            return f"{attr} is {shown}, more digits than an integer holds"
        value = number
    if not isinstance(value, int):
        kind = "an array" if isinstance(value, list) else "not a number"
        kind = "a key-value list" if isinstance(value, dict) else kind
        return f"{attr} is {shown}, {kind}, not an integer"
    if value < least:
        return f"{attr} is {shown}, below {least} (a {_noun(attr)} {_LEAST_WHY[least]})"
    return None


def _noun(attr: str) -> str:
    if attr.endswith("world_size"):
        return "world"
    return "local rank" if attr.endswith("local_rank") else "rank"


def check_resources(points: list[Point], catalogue: Catalogue, data: TargetData) -> None:
    """Every catalogue series carries the resource attributes (an OTLP resource's, or the
    labels of a Prometheus series; an empty value is none), the rank, local rank and world
    size as integers (not 0.5, 1.0, NaN, infinity, a bool or "+1") in range: a rank and a
    local rank below the world size, a world size of at least 1, one world size for all of a
    run's series. A node's GPU or host series with neither a run id nor a rank is the node's
    own (`NODE_ATTRIBUTES` only, `points.is_node_point`)."""
    seen: set[str] = set()
    worlds: dict[str, dict[int, int | None]] = {}  # run id -> world size -> a rank claiming it
    for p in points:
        if p.name not in catalogue.metrics:
            continue
        values = tuple(p.attribute(a) for a in catalogue.resource_attributes)
        node = is_node_point(p)
        key = repr((node, values))  # an OTLP array or key-value attribute decodes to a list
        if key in seen:
            continue
        seen.add(key)
        rank = as_int(p.attribute(RANK_ATTR))
        world = as_int(p.attribute(WORLD_SIZE_ATTR))
        if world is not None and world >= 1:
            worlds.setdefault(repr(p.attribute(RUN_ATTR)), {}).setdefault(world, rank)
        _check_values(catalogue, values, node, rank, world, data)
    for run, sizes in worlds.items():
        if len(sizes) > 1:
            claims = ", ".join(
                f"{w} (rank {'?' if r is None else r})" for w, r in sorted(sizes.items())
            )
            data.resource_invalid.append(
                (None, f"{WORLD_SIZE_ATTR} differs across the series of run {run}: {claims}")
            )


def _check_values(
    catalogue: Catalogue,
    values: tuple[object, ...],
    node: bool,
    rank: int | None,
    world: int | None,
    data: TargetData,
) -> None:
    """One resource's attributes: present, and the counts valid and within the world."""
    named = dict(zip(catalogue.resource_attributes, values, strict=True))
    for attr, value in named.items():
        if value is None and node and attr not in NODE_ATTRIBUTES:
            continue
        if value is None:
            data.resource_missing.append((rank, attr))
        elif is_blank(value):
            data.resource_missing.append((rank, f"{attr} (empty value)"))
        elif attr in COUNTS:
            fault = count_fault(attr, value, COUNTS[attr])
            if fault:
                data.resource_invalid.append((rank if attr != RANK_ATTR else None, fault))
    if world is None or world < 1 or count_fault(WORLD_SIZE_ATTR, named.get(WORLD_SIZE_ATTR), 1):
        return
    if rank is not None and rank >= world and not count_fault(RANK_ATTR, named.get(RANK_ATTR), 0):
        # `points._infer_ranks` widens the world to hold the rank; the claim is still
        # wrong (a rank 5 of 2, two ranks in a world of 1): its attributes contradict.
        data.resource_invalid.append((rank, rank_outside_world(rank, world)))
    local = named.get(LOCAL_RANK_ATTR)
    if local is not None and not count_fault(LOCAL_RANK_ATTR, local, 0):
        local_rank = as_int(local)
        if local_rank is not None and local_rank >= world:
            data.resource_invalid.append(
                (rank, f"{LOCAL_RANK_ATTR} {local_rank} is not below world size {world}")
            )
