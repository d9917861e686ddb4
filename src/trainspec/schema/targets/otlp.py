"""Decode OTLP metrics payloads (protobuf or OTLP/JSON) into normalized `Point`s.

The payload is an `ExportMetricsServiceRequest` (opentelemetry-proto), as an OTLP/HTTP
exporter POSTs it to `/v1/metrics`: `application/x-protobuf` or `application/json`. OTLP/JSON
is the protobuf JSON mapping with lowerCamelCase names, enums as integers and 64-bit integers
as strings, so `google.protobuf.json_format` reads it; exemplars are dropped before parsing
because their ids are hex in OTLP/JSON, not base64 (OTLP specification, "JSON Protobuf
Encoding"). JSON Lines of requests (the OpenTelemetry Collector's file exporter) read as
their requests merged. `decode_otlp` raises `TargetError` with a one-line reason on anything else.
"""

from __future__ import annotations

import json
import math
from typing import Any

from trainspec.schema.targets.model import TargetError
from trainspec.schema.targets.points import Point

_TEMPORALITY = {1: "delta", 2: "cumulative"}
JSON_TYPES = ("application/json",)
PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf", "application/octet-stream")


def _proto():
    try:
        from google.protobuf import json_format
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    except ImportError as exc:
        raise TargetError(
            "reading OTLP needs opentelemetry-proto (pip install 'trainspec[otel]')"
        ) from exc
    return metrics_service_pb2.ExportMetricsServiceRequest, json_format, DecodeError


def _any_value(v: Any) -> object:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _attributes(kvs: Any) -> dict[str, object]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def _secs(nanos: int) -> float | None:
    return nanos / 1e9 if nanos else None


def _number(dp: Any) -> float | None:
    which = dp.WhichOneof("value")
    return float(getattr(dp, which)) if which else None


def _metric_points(metric: Any, resource: dict, scope: str) -> list[Point]:
    kind = metric.WhichOneof("data")
    base: dict[str, Any] = {
        "name": metric.name,
        "unit": metric.unit,
        "resource": resource,
        "scope": scope,
    }
    if kind in ("gauge", "sum"):
        data = getattr(metric, kind)
        extra: dict[str, Any] = {}
        if kind == "sum":
            extra = {
                "monotonic": data.is_monotonic,
                "temporality": _TEMPORALITY.get(data.aggregation_temporality),
                "malformed": _temporality_fault(data),
            }
        return [
            Point(
                kind=kind,
                ts=_secs(dp.time_unix_nano),
                value=_number(dp),
                attributes=_attributes(dp.attributes),
                start_ts=_secs(dp.start_time_unix_nano),
                **(extra | {"malformed": extra.get("malformed") or _start_fault(dp)}),
                **base,
            )
            for dp in data.data_points
        ]
    if kind in ("histogram", "exponential_histogram"):
        data = getattr(metric, kind)
        out = []
        for dp in data.data_points:
            explicit = kind == "histogram"
            malformed = (
                _temporality_fault(data)
                or (_explicit_fault(dp) if explicit else _exponential_fault(dp))
                or _range_fault(dp)
                or _start_fault(dp)
            )
            out.append(
                Point(
                    kind=kind,
                    ts=_secs(dp.time_unix_nano),
                    attributes=_attributes(dp.attributes),
                    temporality=_TEMPORALITY.get(data.aggregation_temporality),
                    start_ts=_secs(dp.start_time_unix_nano),
                    count=dp.count,
                    sum=dp.sum if dp.HasField("sum") else None,
                    min=dp.min if dp.HasField("min") else None,
                    max=dp.max if dp.HasField("max") else None,
                    bucket_bounds=tuple(dp.explicit_bounds) if explicit else (),
                    bucket_counts=tuple(dp.bucket_counts) if explicit else (),
                    malformed=malformed,
                    **base,
                )
            )
        return out
    if kind == "summary":
        return [
            Point(
                kind="summary",
                ts=_secs(dp.time_unix_nano),
                count=dp.count,
                sum=dp.sum,
                attributes=_attributes(dp.attributes),
                start_ts=_secs(dp.start_time_unix_nano),
                malformed=_start_fault(dp),
                **base,
            )
            for dp in metric.summary.data_points
        ]
    return []  # a metric with no data carries nothing to judge


def _temporality_fault(data: Any) -> str | None:
    """A sum or histogram must say whether its points are deltas or cumulative: OTLP's
    `AGGREGATION_TEMPORALITY_UNSPECIFIED` "MUST NOT be used" (`metrics.proto`)."""
    if data.aggregation_temporality in _TEMPORALITY:
        return None
    return (
        f"has aggregation temporality {data.aggregation_temporality} (UNSPECIFIED is not allowed)"
    )


def _start_fault(dp: Any) -> str | None:
    """A data point's start time is at or before its time (`metrics.proto`: the interval is
    (start_time_unix_nano, time_unix_nano]); 0 is an unset start, and an unset time is the
    `time` rule's."""
    start, end = dp.start_time_unix_nano, dp.time_unix_nano
    if start and end and start > end:
        return f"has start_time_unix_nano {start} after its time_unix_nano {end}"
    return None


def _range_fault(dp: Any) -> str | None:
    """A histogram point's min is at most its max (both observed values of one interval)."""
    if dp.HasField("min") and dp.HasField("max") and dp.min > dp.max:
        return f"has min {dp.min:g} above its max {dp.max:g}"
    return None


def _explicit_fault(dp: Any) -> str | None:
    """What breaks an explicit-bucket histogram point (opentelemetry-proto `metrics.proto`):
    one more bucket count than bounds (or neither), bounds that are numbers and strictly
    increase, bucket counts that sum to the point's count."""
    bounds, counts = list(dp.explicit_bounds), list(dp.bucket_counts)
    if not counts and not bounds:
        # `metrics.proto` lets a point carry no buckets at all, but then it is a count and a
        # sum, which no range or latency rule can read: every SDK's explicit-bucket
        # aggregation sends at least the one (+Inf) bucket.
        return "has no bucket counts (an explicit-bucket histogram has at least the +Inf bucket's)"
    if len(counts) != len(bounds) + 1:
        return (
            f"has {len(counts)} bucket count{'s' * (len(counts) != 1)} for {len(bounds)} "
            f"bound{'s' * (len(bounds) != 1)} (needs {len(bounds) + 1})"
        )
    if any(math.isnan(b) for b in bounds):
        return "has a NaN bucket bound"
    for lo, hi in zip(bounds, bounds[1:]):
        if not lo < hi:
            return f"has bucket bounds that do not increase ({lo:g} then {hi:g})"
    if counts and sum(counts) != dp.count:
        return f"has count {dp.count} but its bucket counts sum to {sum(counts)}"
    return None


def _exponential_fault(dp: Any) -> str | None:
    """An exponential histogram point's count is its zero count plus every bucket's."""
    total = dp.zero_count + sum(dp.positive.bucket_counts) + sum(dp.negative.bucket_counts)
    if total != dp.count:
        return f"has count {dp.count} but its zero and bucket counts sum to {total}"
    return None


def check_wire(points: list[Point]) -> None:
    """Raise TargetError (one line, naming the metric and the fault) for the first point that
    breaks its wire format: a histogram's counts, bounds, total or min above max, a sum's or
    histogram's temporality left unspecified. The Prometheus reader
    refuses the same faults in an exposition; the agent, which forwards what it takes and
    shows no OTLP histogram, does not call this."""
    for p in points:
        if p.malformed:
            raise TargetError(f"malformed OTLP {p.kind}: {p.name} data point {p.malformed}")


def _strip_exemplars(node: object) -> object:
    if isinstance(node, dict):
        return {k: _strip_exemplars(v) for k, v in node.items() if k != "exemplars"}
    if isinstance(node, list):
        return [_strip_exemplars(v) for v in node]
    return node


def _parse(body: bytes, content_type: str, *, json_lines: bool):
    request_cls, json_format, decode_error = _proto()
    request = request_cls()
    if content_type.split(";")[0].strip().lower() in JSON_TYPES:
        try:
            for doc in _json_documents(body.decode("utf-8"), json_lines=json_lines):
                if not isinstance(doc, dict):
                    raise ValueError(f"the document is a JSON {type(doc).__name__}, not an object")
                one = request_cls()
                json_format.ParseDict(_strip_exemplars(doc), one, ignore_unknown_fields=True)
                request.MergeFrom(one)  # JSON Lines: every request's resources, in order
        except (UnicodeDecodeError, ValueError, TypeError, json_format.ParseError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TargetError(f"not an OTLP/JSON metrics request: {reason}") from exc
        except RecursionError as exc:  # json, the exemplar walk and ParseDict all recurse
            raise TargetError("not an OTLP/JSON metrics request: nested too deeply") from exc
        if not _has_metrics(request):
            raise TargetError("not an OTLP/JSON metrics request: no metrics decoded")
        return request
    try:
        request.ParseFromString(body)
    except (decode_error, ValueError) as exc:
        raise TargetError(f"not an OTLP protobuf metrics request: {exc}") from exc
    # Protobuf parses many byte strings without error (unknown fields are kept), so a
    # request that decoded to nothing, or only to unknown fields, is not a payload.
    from google.protobuf.unknown_fields import UnknownFieldSet

    if len(UnknownFieldSet(request)) or not _has_metrics(request):
        raise TargetError("not an OTLP protobuf metrics request: no metrics decoded")
    return request


def _json_documents(text: str, *, json_lines: bool) -> list[object]:
    """One OTLP/JSON request, or JSON Lines of them: the OpenTelemetry Collector's file
    exporter writes one request per line, which read as "Extra data: line 2". A body that
    is neither raises the single document's error."""
    try:
        return [json.loads(text)]
    except json.JSONDecodeError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        if not json_lines or len(lines) < 2:
            raise
        docs = []
        for number, line in enumerate(lines, 1):
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if number == 1:
                    raise whole from exc  # not JSON Lines either: the document's own error
                raise ValueError(f"JSON Lines request {number}: {exc}") from exc
        return docs


def _has_metrics(request) -> bool:
    return any(sm.metrics for rm in request.resource_metrics for sm in rm.scope_metrics)


def decode_otlp(
    body: bytes, content_type: str = "application/x-protobuf", *, json_lines: bool = False
) -> list[Point]:
    """The data points of one OTLP metrics request; raises TargetError if it is not one.
    `json_lines`: OTLP/JSON may also be one request per line (a file, not an HTTP body)."""
    request = _parse(body, content_type, json_lines=json_lines)
    points: list[Point] = []
    for rm in request.resource_metrics:
        resource = _attributes(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points.extend(_metric_points(metric, resource, sm.scope.name))
    return points
