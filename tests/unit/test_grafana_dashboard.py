"""The Grafana dashboard queries only series trainspec exports, by their Prometheus names."""

from __future__ import annotations

import json
import re

from trainspec.dashboards.grafana_build import DASHBOARD_PATH, render
from trainspec.schema import load_catalogue

LABEL_MATCHERS = re.compile(r"\{[^}]*\}")
GROUPING = re.compile(r"\b(by|without)\s*\([^)]*\)")
IDENT = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b")
PROMQL_WORDS = {
    "histogram_quantile", "sum", "rate", "increase", "avg", "max", "min", "by", "without",
    "le", "label_values",
}  # fmt: skip


def _dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


def _exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def _metric_names(expr: str) -> set[str]:
    bare = GROUPING.sub(" ", LABEL_MATCHERS.sub(" ", expr.replace("$__rate_interval", "")))
    return {w for w in IDENT.findall(bare) if w not in PROMQL_WORDS and not w[0].isdigit()}


def _allowed_names() -> set[str]:
    allowed: set[str] = set()
    for metric in load_catalogue():
        name = metric.prometheus_name
        if metric.instrument == "histogram":
            allowed |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            allowed.add(name)
    return allowed


def test_every_query_uses_only_catalogue_prometheus_names():
    allowed = _allowed_names()
    exprs = _exprs(_dashboard())
    assert len(exprs) >= 15
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used, "no metric names found in the queries"
    assert used <= allowed, f"not exported by trainspec: {sorted(used - allowed)}"


def test_histograms_are_read_through_bucket_sum_count_and_counters_end_in_total():
    cat = load_catalogue()
    by_prom = cat.by_prometheus_name()
    for name in set().union(*(_metric_names(e) for e in _exprs(_dashboard()))):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        metric = by_prom.get(name) or by_prom[base]
        if metric.instrument == "histogram":
            assert name != metric.prometheus_name, f"{name}: a histogram has no bare series"
        if metric.instrument in ("counter", "event"):
            assert name.endswith("_total")


def test_checker_rejects_a_name_the_catalogue_lacks():
    names = _metric_names('rate(trainspec_step_seconds_total{trainspec_rank="0"}[5m])')
    assert names == {"trainspec_step_seconds_total"}
    assert not names <= _allowed_names()


def test_headline_families_each_have_a_panel():
    text = " ".join(_exprs(_dashboard()))
    for name in (
        "trainspec.step.duration", "trainspec.gpu.utilization", "trainspec.memory.pressure",
        "trainspec.comm.probe.latency", "trainspec.grad.variance", "trainspec.grad.noise_scale",
    ):  # fmt: skip
        assert load_catalogue()[name].prometheus_name in text


def test_dashboard_is_for_a_prometheus_data_source_with_a_run_variable():
    doc = _dashboard()
    assert {p["datasource"]["type"] for p in doc["panels"]} == {"prometheus"}
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "trainspec_run_id" in variables["run"]["query"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


def test_committed_json_matches_the_generator():
    assert DASHBOARD_PATH.read_text() == render(), (
        "regenerate: python -m trainspec.dashboards.grafana_build"
    )
