"""Prometheus expositions and OTLP payloads built from a SyntheticRun (tests/helpers/runs.py).

Both are written with the real libraries (prometheus_client's exposition writer and the
opentelemetry-proto message classes), so the validator's readers are tested on real output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from tests.helpers.runs import SyntheticRun, gpu_attrs
from trainspec.schema import Metric, load_catalogue

BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0)


def resource_attrs(rank: int, world_size: int) -> dict[str, object]:
    return {
        "service.name": "synthetic",
        "trainspec.run.id": "synthetic",
        "host.name": "testhost",
        "trainspec.rank": rank,
        "trainspec.local_rank": rank,
        "trainspec.world_size": world_size,
    }


def series_of(run: SyntheticRun) -> dict[tuple[str, int, str], list[tuple[float, float | None]]]:
    """(metric, rank, attrs JSON) -> [(ts, value)] for every catalogue metric the run holds."""
    cat = load_catalogue()
    out: dict[tuple[str, int, str], list[tuple[float, float | None]]] = {}
    for r in run.samples:
        out.setdefault((r["metric"], r["rank"], r["attrs"]), []).append((r["ts"], r["value"]))
    for metric in cat.in_table("steps"):
        for r in run.steps:
            value = r[metric.store_column or ""]
            if value is not None:
                out.setdefault((metric.name, r["rank"], "{}"), []).append((r["ts"], float(value)))
    return out


# ---------------------------------------------------------------- Prometheus


def _label(attr: str) -> str:
    return attr.replace(".", "_")


class _SnapshotCollector:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _family(metric: Metric, name: str, labels: list[str]):
    doc = metric.description or metric.name
    if metric.instrument in ("counter", "event"):
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
    if metric.instrument == "histogram":
        return HistogramMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


def _add(family, metric: Metric, labels: list[str], values: list[float]) -> None:
    if metric.instrument == "histogram":
        finite = [v for v in values if not math.isnan(v)]
        buckets = [(str(b), float(sum(1 for v in finite if v <= b))) for b in BUCKETS_S]
        buckets.append(("+Inf", float(len(values))))
        family.add_metric(labels, buckets, sum_value=sum(values))
    else:
        family.add_metric(labels, values[-1])


def prometheus_exposition(
    run: SyntheticRun, *, rename: dict[str, str] | None = None, every_metric: bool = False
) -> bytes:
    """The text exposition a scrape at the end of `run` would see (no timestamps).

    `rename` maps catalogue names to the Prometheus family name to write instead (to break
    units); `every_metric` adds one series for each catalogue metric the run lacks, with its
    required attributes as labels, so the exposition covers the whole catalogue.
    """
    cat = load_catalogue()
    rename = rename or {}
    grouped: dict[str, list[tuple[dict, list[float]]]] = {}
    for (name, rank, attrs_json), points in series_of(run).items():
        labels = {_label(k): str(v) for k, v in resource_attrs(rank, run.ranks).items()} | {
            _label(k): str(v) for k, v in json.loads(attrs_json).items()
        }
        grouped.setdefault(name, []).append((labels, [v for _, v in points]))
    if every_metric:
        for metric in cat:
            if metric.name in grouped:
                continue
            attrs = {"kind": "fault", "reason": "synthetic", "direction": "tx"} | gpu_attrs(0)
            labels = {_label(k): str(v) for k, v in resource_attrs(0, run.ranks).items()}
            labels |= {_label(a): str(attrs[a]) for a in metric.required_attributes}
            grouped[metric.name] = [(labels, [0.5 if metric.unit == "1" else 1.0])]
    families = []
    for name, series in grouped.items():
        metric = cat[name]
        label_names = sorted(series[0][0])
        family = _family(metric, rename.get(name, metric.prometheus_name), label_names)
        for labels, values in series:
            _add(family, metric, [labels[k] for k in label_names], values)
        families.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(families))
    return generate_latest(registry)


# ---------------------------------------------------------------- OTLP


def _kv(attrs: dict[str, object]) -> list[KeyValue]:
    out = []
    for k, v in attrs.items():
        if isinstance(v, bool):
            any_value = AnyValue(bool_value=v)
        elif isinstance(v, int):
            any_value = AnyValue(int_value=v)
        elif isinstance(v, float):
            any_value = AnyValue(double_value=v)
        else:
            any_value = AnyValue(string_value=str(v))
        out.append(KeyValue(key=k, value=any_value))
    return out


def _otlp_metric(metric: Metric, unit: str, series: list[tuple[dict, list]]) -> pb.Metric:
    m = pb.Metric(name=metric.name, unit=unit, description=metric.description)
    cumulative = pb.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    for attrs, points in series:
        for ts, value in points:
            nanos = int(ts * 1e9)
            if metric.instrument == "histogram":
                counts = [
                    1 if (value <= b and (i == 0 or value > BUCKETS_S[i - 1])) else 0
                    for i, b in enumerate(BUCKETS_S)
                ]
                counts.append(1 - sum(counts))
                m.histogram.aggregation_temporality = cumulative
                m.histogram.data_points.add(
                    attributes=_kv(attrs),
                    time_unix_nano=nanos,
                    count=1,
                    sum=value,
                    min=value,
                    max=value,
                    explicit_bounds=list(BUCKETS_S),
                    bucket_counts=counts,
                )
            elif metric.instrument in ("counter", "event"):
                m.sum.aggregation_temporality = cumulative
                m.sum.is_monotonic = True
                m.sum.data_points.add(attributes=_kv(attrs), time_unix_nano=nanos, as_double=value)
            else:
                m.gauge.data_points.add(
                    attributes=_kv(attrs), time_unix_nano=nanos, as_double=value
                )
    return m


def otlp_request(
    run: SyntheticRun, *, units: dict[str, str] | None = None
) -> ExportMetricsServiceRequest:
    """One request holding every point of `run`, one ResourceMetrics per rank.

    `units` maps catalogue names to the unit to declare instead (to break units).
    """
    cat = load_catalogue()
    units = units or {}
    by_rank: dict[int, dict[str, list[tuple[dict, list]]]] = {}
    for (name, rank, attrs_json), points in series_of(run).items():
        by_rank.setdefault(rank, {}).setdefault(name, []).append((json.loads(attrs_json), points))
    request = ExportMetricsServiceRequest()
    for rank, metrics in sorted(by_rank.items()):
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(_kv(resource_attrs(rank, run.ranks)))
        sm = rm.scope_metrics.add()
        sm.scope.name = "trainspec"
        for name, series in metrics.items():
            metric = cat[name]
            sm.metrics.append(_otlp_metric(metric, units.get(name, metric.unit), series))
    return request


def otlp_json(request: ExportMetricsServiceRequest) -> bytes:
    """OTLP/JSON as an exporter sends it: lowerCamelCase, enums as integers."""
    from google.protobuf.json_format import MessageToJson

    return MessageToJson(request, use_integers_for_enums=True).encode()


def write_single_export(path: Path) -> Path:
    """One rank's single OTLP export, as a periodic exporter sends it: each series' last
    point and the last step (no series holds two timed points)."""
    from tests.helpers.runs import synthetic_run

    run = synthetic_run(1, 1.0, False)
    last: dict = {}
    for r in run.samples:
        last[(r["metric"], r["attrs"])] = r
    run.samples = list(last.values())
    run.steps = run.steps[-1:]
    path.write_bytes(otlp_request(run).SerializeToString())
    return path
