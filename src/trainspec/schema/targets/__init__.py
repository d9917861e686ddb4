"""Readers for what `trainspec validate` judges: runs, Prometheus expositions, OTLP payloads.

`read_target(target, catalogue)` picks the reader from the target itself (a URL, a run
directory or `.duckdb`, else the file's suffix and first bytes) and returns `TargetData`;
anything unreadable raises `TargetError` with a one-line reason.
"""

from __future__ import annotations

from pathlib import Path

from trainspec.schema.catalogue import Catalogue
from trainspec.schema.targets.model import TargetData, TargetError
from trainspec.schema.targets.otlp import check_wire, decode_otlp
from trainspec.schema.targets.points import (
    RANK_ATTR,
    Point,
    as_int,
    build_target,
    is_node_point,
)

__all__ = ["Point", "TargetData", "TargetError", "decode_otlp", "read_target"]

OTLP_JSON_SUFFIXES = (".json",)
OTLP_PROTO_SUFFIXES = (".pb", ".bin", ".otlp", ".protobuf")
PROMETHEUS_SUFFIXES = (".prom", ".txt", ".metrics", ".om")


# Resource attributes that are counts: a rank of "abc" or -3 named no rank at all.
_COUNTS = {RANK_ATTR: 0, "trainspec.local_rank": 0, "trainspec.world_size": 1}
# A node's own series (a node agent's readings of its GPUs and host: no run, no rank) carry
# the node's attributes only.
NODE_ATTRIBUTES = ("service.name", "host.name")


def _check_resources(points: list[Point], catalogue: Catalogue, data: TargetData) -> None:
    """Every catalogue series carries the resource attributes (an OTLP resource's, or the
    labels of a Prometheus series), the rank and world size as whole numbers (not 0.5, NaN,
    infinity or a bool): an exposition without them was judged compliant, with a rank of
    `?`. A node's GPU or host series with neither a run id nor a rank is the node's own
    (`NODE_ATTRIBUTES` only, `points.is_node_point`)."""
    seen: set[str] = set()
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
        for attr, value in zip(catalogue.resource_attributes, values, strict=True):
            if value is None and node and attr not in NODE_ATTRIBUTES:
                continue
            if value is None:
                data.resource_missing.append((rank, attr))
            elif attr in _COUNTS:
                number = as_int(value)
                if number is None or number < _COUNTS[attr]:
                    least = _COUNTS[attr]
                    data.resource_invalid.append(
                        (
                            rank if attr != RANK_ATTR else None,
                            f"{attr} is {value!r}, not a whole number of at least {least}",
                        )  # fmt: skip
                    )


def _from_otlp(body: bytes, content_type: str, source: str, catalogue: Catalogue) -> TargetData:
    points = decode_otlp(body, content_type)
    check_wire(points)  # a malformed histogram exits 2, as a Prometheus one does
    data = build_target(points, catalogue, source=source, kind="otlp", prefix="trainspec.")
    _check_resources(points, catalogue, data)
    return data


def _from_prometheus(body: bytes, source: str, catalogue: Catalogue) -> TargetData:
    from trainspec.schema.targets.prometheus_text import parse_exposition

    points = parse_exposition(body, catalogue)
    data = build_target(points, catalogue, source=source, kind="prometheus", prefix="trainspec_")
    _check_resources(points, catalogue, data)
    return data


def _sniff(body: bytes, suffix: str, source: str, catalogue: Catalogue) -> TargetData:
    if suffix in OTLP_JSON_SUFFIXES or body.lstrip()[:1] == b"{":
        return _from_otlp(body, "application/json", source, catalogue)
    if suffix in OTLP_PROTO_SUFFIXES:
        return _from_otlp(body, "application/x-protobuf", source, catalogue)
    if suffix in PROMETHEUS_SUFFIXES:
        return _from_prometheus(body, source, catalogue)
    try:
        return _from_prometheus(body, source, catalogue)
    except TargetError as prom_error:
        try:
            return _from_otlp(body, "application/x-protobuf", source, catalogue)
        except TargetError as otlp_error:
            raise TargetError(
                f"{source}: not a run, Prometheus exposition or OTLP payload "
                f"({prom_error}; {otlp_error})"
            ) from otlp_error


def read_target(target: str, catalogue: Catalogue) -> TargetData:
    """Read any supported target; raises TargetError (one line) when it cannot be read."""
    if target.startswith(("http://", "https://")):
        from trainspec.schema.targets.prometheus_text import fetch

        body = fetch(target)  # its errors already name the URL
        try:
            return _from_prometheus(body, target, catalogue)
        except TargetError as exc:
            raise TargetError(f"{target}: {exc}") from exc
    path = Path(target)
    if path.is_dir() or path.suffix == ".duckdb":
        raise TargetError(f"{target}: a run is read by trainspec.store.compliance.validate_target")
    from trainspec.schema.targets.prometheus_text import MAX_BODY_BYTES

    try:
        with path.open("rb") as fh:
            body = fh.read(MAX_BODY_BYTES + 1)
    except OSError as exc:
        raise TargetError(f"{target}: cannot read: {exc.strerror or exc}") from exc
    if len(body) > MAX_BODY_BYTES:
        raise TargetError(f"{target}: larger than {MAX_BODY_BYTES >> 20} MiB; not judged")
    if not body.strip():
        raise TargetError(f"{target}: empty file")
    try:
        return _sniff(body, path.suffix.lower(), target, catalogue)
    except TargetError as exc:
        msg = str(exc)
        raise TargetError(msg if msg.startswith(target) else f"{target}: {msg}") from exc
