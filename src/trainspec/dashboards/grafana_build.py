"""Generates `grafana/trainspec.json`: a Grafana dashboard over trainspec's Prometheus series.

Every query is written from catalogue entries (`Metric.prometheus_name`), never from typed
names: histograms are read through `_bucket` / `_sum` / `_count`, counters already end in
`_total`. Labels are the resource attributes as the Prometheus sink writes them
(`trainspec_run_id`, `trainspec_rank`, `gpu_index`). The `run` variable may pick several runs,
so every per-rank series is grouped by run and rank (`PER_RANK`) and its legend names both:
summed by rank alone, rank 0 of two runs would be drawn as one line. Regenerate after a
catalogue change:

    python -m trainspec.dashboards.grafana_build src/trainspec/dashboards/grafana/trainspec.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainspec.schema import load_catalogue

DASHBOARD_PATH = Path(__file__).with_name("grafana") / "trainspec.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'trainspec_run_id=~"$run"'
WINDOW = "$__rate_interval"
PER_RANK = "trainspec_run_id, trainspec_rank"


def prom(name: str) -> str:
    return load_catalogue()[name].prometheus_name


def quantile(name: str, q: float, by: str = PER_RANK) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, {by}) (rate({prom(name)}_bucket{{{RUN}}}[{WINDOW}])))"
    )


def mean(name: str, by: str = PER_RANK) -> str:
    p = prom(name)
    return (
        f"sum by ({by}) (rate({p}_sum{{{RUN}}}[{WINDOW}])) / "
        f"sum by ({by}) (rate({p}_count{{{RUN}}}[{WINDOW}]))"
    )


def compute(by: str = PER_RANK) -> str:
    """Mean compute per step: forward + backward less the exposed communication, which
    backward includes (catalogue; `sql.COMPUTE_SQL`). A rank with no exposed-communication
    series (one rank, no gradient hook) counts it as 0 rather than dropping out."""
    fwd, bwd, exposed = (
        mean(f"trainspec.step.{p}", by) for p in ("forward", "backward", "comm_exposed")
    )
    return f"({fwd}) + ({bwd}) - (({exposed}) or ({fwd}) * 0)"


def gauge(name: str) -> str:
    return f"{prom(name)}{{{RUN}}}"


def rate(name: str, by: str = PER_RANK) -> str:
    return f"sum by ({by}) (rate({prom(name)}{{{RUN}}}[{WINDOW}]))"


def _target(expr: str, legend: str, ref: int) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + ref)}


def _panel(
    pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int, *,
    kind: str = "timeseries", w: int = 12, h: int = 8, description: str = "",
) -> dict[str, Any]:  # fmt: skip
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [_target(e, legend, i) for i, (e, legend) in enumerate(exprs)],
    }


def _panels() -> list[dict[str, Any]]:
    r = "run {{trainspec_run_id}} rank {{trainspec_rank}}"
    g = "GPU {{gpu_index}} " + r
    specs = [
        ("Step time p50 / p95 per rank", [
            (quantile("trainspec.step.duration", 0.5), f"p50 {r}"),
            (quantile("trainspec.step.duration", 0.95), f"p95 {r}")], "s", "timeseries", ""),
        ("Compute per rank (forward + backward - exposed communication): a straggler is a "
         "bright row", [(compute(), r)], "s", "status-history",
         "Mean forward + backward per step, less the exposed gradient-sync wait that backward "
         "includes: a rank waiting for a straggler does not look slow (as the app's "
         "COMPUTE_SQL). A rank that records no exposed communication counts it as 0."),
        ("Step phases (mean per step)", [
            (mean(f"trainspec.step.{p}"), f"{p} {r}")
            for p in ("data_wait", "forward", "backward", "optimizer", "comm_exposed")],
            "s", "timeseries", ""),
        ("Throughput per rank", [(gauge("trainspec.step.throughput"), r)], "short", "timeseries", ""),
        ("GPU utilization", [(gauge("trainspec.gpu.utilization"), g)], "percentunit", "timeseries", ""),
        ("CPU utilization (process)", [
            (gauge("trainspec.process.cpu.utilization"), r)], "percentunit", "timeseries", ""),
        ("Memory pressure", [(gauge("trainspec.memory.pressure"), r)], "percentunit", "timeseries", ""),
        ("Collective latency (probe all-reduce) p50 / p99", [
            (quantile("trainspec.comm.probe.latency", 0.5), f"p50 {r}"),
            (quantile("trainspec.comm.probe.latency", 0.99), f"p99 {r}")], "s", "timeseries", ""),
        ("All-reduce duration and exposed communication (mean)", [
            (mean("trainspec.comm.allreduce.duration"), f"all-reduce {r}"),
            (mean("trainspec.step.comm_exposed"), f"exposed {r}")], "s", "timeseries", ""),
        ("Gradient variance", [(gauge("trainspec.grad.variance"), r)], "short", "timeseries", ""),
        ("Gradient noise scale (McCandlish et al. 2018)", [
            (gauge("trainspec.grad.noise_scale"), r)], "short", "timeseries", ""),
        ("Gradient bytes on the wire", [(rate("trainspec.comm.bytes"), r)], "Bps", "timeseries", ""),
        ("GPU power", [(gauge("trainspec.gpu.power"), g)], "watt", "timeseries", ""),
        ("GPU memory used", [(gauge("trainspec.gpu.memory.used"), g)], "bytes", "timeseries", ""),
        ("Anomalies and actions", [
            (rate("trainspec.anomalies", by=f"{PER_RANK}, kind"), "anomaly {{kind}} " + r),
            (rate("trainspec.actions", by=f"{PER_RANK}, kind"), "action {{kind}} " + r)],
            "short", "timeseries", ""),
        ("Telemetry points dropped", [(rate("trainspec.telemetry.dropped"), r)], "short",
         "timeseries", "Points refused so that training never blocked."),
    ]  # fmt: skip
    panels = []
    for i, (title, exprs, unit, kind, desc) in enumerate(specs):
        x, y = (i % 2) * 12, (i // 2) * 8
        panels.append(_panel(i + 1, title, exprs, unit, x, y, kind=kind, description=desc))
    return panels


def build_dashboard() -> dict[str, Any]:
    catalogue = load_catalogue()
    run_var = prom("trainspec.step.duration") + "_count"
    return {
        "uid": "trainspec",
        "title": "trainspec: training run",
        "description": f"trainspec catalogue {catalogue.version}, Prometheus data source",
        "tags": ["trainspec", "pytorch", "training"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                },
                {
                    "name": "run",
                    "type": "query",
                    "datasource": DS,
                    "label": "run",
                    "query": f"label_values({run_var}, trainspec_run_id)",
                    "includeAll": True,
                    "multi": True,
                    "refresh": 2,
                },
            ]
        },  # fmt: skip
        "panels": _panels(),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DASHBOARD_PATH
    target.write_text(render())
