"""Readers for what `trainspec validate` judges: runs, Prometheus expositions, OTLP payloads.

`read_target(target, catalogue)` picks the reader from the target itself (a URL, a run
directory or `.duckdb`, else the file's suffix and first bytes) and returns `TargetData`;
anything unreadable raises `TargetError` with a one-line reason.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from trainspec.schema.catalogue import Catalogue
from trainspec.schema.targets.model import TargetData, TargetError, percentile
from trainspec.schema.targets.otlp import check_wire, decode_otlp
from trainspec.schema.targets.points import Point, build_target
from trainspec.schema.targets.resources import check_resources

__all__ = ["Point", "TargetData", "TargetError", "decode_otlp", "read_target"]

OTLP_JSON_SUFFIXES = (".json", ".jsonl")
OTLP_PROTO_SUFFIXES = (".pb", ".bin", ".otlp", ".protobuf")
PROMETHEUS_SUFFIXES = (".prom", ".txt", ".metrics", ".om")


def _from_otlp(body: bytes, content_type: str, source: str, catalogue: Catalogue) -> TargetData:
    # A file may hold JSON Lines of requests (a collector's file exporter); a request over
    # OTLP/HTTP, as the agent takes it, is one document.
    points = decode_otlp(body, content_type, json_lines=True)
    check_wire(points)  # a malformed histogram exits 2, as a Prometheus one does
    # Every OTLP data point has a time (`time_unix_nano` is required); 0 is none, which
    # decodes to None, read as "no timestamp" and passed. NaN makes it the `time` violation
    # of a stored row with no finite time.
    points = [p if p.ts is not None else replace(p, ts=math.nan) for p in points]
    data = build_target(points, catalogue, source=source, kind="otlp", prefix="trainspec.")
    check_resources(points, catalogue, data)
    data.export_interval_s, data.export_gaps = _export_interval(points)
    return data


def _export_interval(points: list[Point]) -> tuple[float | None, int]:
    """The median gap between one resource's successive collection times (an OTel SDK
    stamps every point of one export with the export's time), over every resource; None
    where no resource has two. Consecutive exports of one rank, merged in one request or
    read from a collector's file, failed cadence at the export interval (1 s) against a
    0.05 s sampling interval that an export cannot show. A payload of raw samples (tests',
    at the samplers' own times) gives a gap no longer than its samplers' intervals. Also
    how many gaps it is the median of."""
    times: dict[str, set[float]] = {}
    for p in points:
        if p.ts is not None and math.isfinite(p.ts):
            times.setdefault(repr(sorted(p.resource.items(), key=str)), set()).add(p.ts)
    gaps = []
    for stamps in times.values():
        ordered = sorted(stamps)
        gaps += [b - a for a, b in zip(ordered, ordered[1:])]
    return (percentile(gaps, 0.5) if gaps else None), len(gaps)


def _from_prometheus(body: bytes, source: str, catalogue: Catalogue) -> TargetData:
    from trainspec.schema.targets.prometheus_text import parse_exposition

    points = parse_exposition(body, catalogue)
    data = build_target(points, catalogue, source=source, kind="prometheus", prefix="trainspec_")
    check_resources(points, catalogue, data)
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
