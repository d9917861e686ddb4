"""The Grafana dashboard queries only series trainspec exports, by their Prometheus names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from trainspec.dashboards.grafana_build import DASHBOARD_PATH, render
from trainspec.schema import load_catalogue

LABEL_MATCHERS = re.compile(r"\{[^}]*\}")
GROUPING = re.compile(r"\b(by|without)\s*\([^)]*\)")
IDENT = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b")
PROMQL_WORDS = {
    "histogram_quantile", "sum", "rate", "increase", "avg", "max", "min", "by", "without",
    "le", "label_values", "or",
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


PROMTOOL = shutil.which("promtool")
# Per step, seconds: a fast rank that waits 0.3 s in backward for the straggler's gradients,
# the straggler (no wait), and a rank with no exposed-communication series at all.
PHASES = {
    "0": {"forward": 0.1, "backward": 0.5, "comm_exposed": 0.3},
    "1": {"forward": 0.2, "backward": 0.4, "comm_exposed": 0.0},
    "2": {"forward": 0.1, "backward": 0.2},
}
STEPS_PER_MINUTE = 10
# A second run picked beside the first (the run variable is multi-value, with All): its
# ranks share the first run's rank numbers and take twice as long.
RUNS = {"r1": 1.0, "r2": 2.0}


def _labels(run: str, rank: str, **more: str) -> str:
    extra = "".join(f',{k}="{v}"' for k, v in more.items())
    return f'{{trainspec_run_id="{run}",trainspec_rank="{rank}"{extra}}}'


def _input_series() -> list[dict[str, str]]:
    """Histogram `_sum` and `_count` series, as the Prometheus sink names them, growing by
    a constant amount per minute: rate(sum) / rate(count) is exactly the per-step mean."""
    series = []
    for run, scale in RUNS.items():
        for rank, phases in PHASES.items():
            for phase, seconds in phases.items():
                name = load_catalogue()[f"trainspec.step.{phase}"].prometheus_name
                per_minute = round(seconds * scale * STEPS_PER_MINUTE, 9)
                labels = _labels(run, rank)
                series.append({"series": f"{name}_sum{labels}", "values": f"0+{per_minute}x20"})
                series.append(
                    {"series": f"{name}_count{labels}", "values": f"0+{STEPS_PER_MINUTE}x20"}
                )
    return series


def _target(title: str, index: int = 0) -> dict:
    (panel,) = [p for p in _dashboard()["panels"] if p["title"].startswith(title)]
    return panel["targets"][index]


def _promtool_eval(tmp_path, target: dict, input_series: list, expected: list) -> None:
    """promtool evaluates the committed query (every run picked) at 15 min over the series."""
    expr = target["expr"].replace("$__rate_interval", "5m").replace('=~"$run"', '=~".*"')
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input_series,
            "promql_expr_test": [{"expr": expr, "eval_time": "15m", "exp_samples": expected}],
        }],
    }  # fmt: skip
    path = tmp_path / "query_test.yml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.timeout(60)
def test_compute_panel_shows_the_straggler_not_the_rank_waiting_for_it(tmp_path):
    """The panel charted mean backward time, which includes the gradient-sync wait: the fast
    rank (0.5 s, waiting) looked slower than the straggler (0.4 s). promtool evaluates the
    committed query over series named as the exposition names them."""
    expected = [
        {"labels": _labels(run, rank),
         "value": round(scale * (p["forward"] + p["backward"] - p.get("comm_exposed", 0.0)), 9)}
        for run, scale in RUNS.items() for rank, p in PHASES.items()
    ]  # fmt: skip
    _promtool_eval(tmp_path, _target("Compute per rank"), _input_series(), expected)


def test_every_per_rank_series_is_grouped_and_named_by_run_and_rank():
    """The run variable picks several runs (or All), but every query summed `by
    (trainspec_rank)` and every legend said only the rank: rank 0 of two runs was one line."""
    for panel in _dashboard()["panels"]:
        for target in panel["targets"]:
            expr, legend = target["expr"], target["legendFormat"]
            assert re.search(r"\b(sum|avg|min|max|count)\s*\(", expr) is None, expr
            for grouping in re.findall(r"\bby\s*\(([^)]*)\)", expr):
                names = {n.strip() for n in grouping.split(",")}
                assert {"trainspec_run_id", "trainspec_rank"} <= names, (panel["title"], expr)
            assert "{{trainspec_run_id}}" in legend and "{{trainspec_rank}}" in legend, legend


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.timeout(60)
def test_two_runs_rank_0_step_phase_stay_two_lines(tmp_path):
    """QA grafana_repro/test.yml: rank 0 of run A (0.1 s) and of run B (0.9 s) came out as
    one line at 0.5."""
    name = load_catalogue()["trainspec.step.forward"].prometheus_name
    series = []
    for run, per_minute in (("A", 6), ("B", 54)):  # 60 steps a minute, 0.1 s and 0.9 s each
        series.append({"series": f"{name}_sum{_labels(run, '0')}", "values": f"0+{per_minute}x20"})
        series.append({"series": f"{name}_count{_labels(run, '0')}", "values": "0+60x20"})
    expected = [{"labels": _labels("A", "0"), "value": 0.1},
                {"labels": _labels("B", "0"), "value": 0.9}]  # fmt: skip
    _promtool_eval(tmp_path, _target("Step phases", 1), series, expected)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.timeout(60)
def test_two_runs_rank_0_step_time_quantile_stay_two_lines(tmp_path):
    """Run A's steps all fall under 0.1 s, run B's between 0.1 and 1 s: p50 is 0.05 and
    0.55 (linear within the bucket), not one line for both runs."""
    name = load_catalogue()["trainspec.step.duration"].prometheus_name
    per_minute = {"A": {"0.1": 10, "1.0": 10, "+Inf": 10}, "B": {"0.1": 0, "1.0": 10, "+Inf": 10}}
    series = [
        {"series": f"{name}_bucket{_labels(run, '0', le=le)}", "values": f"0+{n}x20"}
        for run, buckets in per_minute.items() for le, n in buckets.items()
    ]  # fmt: skip
    expected = [{"labels": _labels("A", "0"), "value": 0.05},
                {"labels": _labels("B", "0"), "value": 0.55}]  # fmt: skip
    _promtool_eval(tmp_path, _target("Step time p50"), series, expected)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.timeout(60)
def test_two_runs_rank_0_anomaly_rates_stay_two_lines(tmp_path):
    name = load_catalogue()["trainspec.anomalies"].prometheus_name
    series = [
        {"series": f"{name}{_labels(run, '0', kind='straggler')}", "values": f"0+{n}x20"}
        for run, n in (("A", 6), ("B", 60))
    ]  # fmt: skip
    expected = [{"labels": _labels("A", "0", kind="straggler"), "value": 0.1},
                {"labels": _labels("B", "0", kind="straggler"), "value": 1.0}]  # fmt: skip
    _promtool_eval(tmp_path, _target("Anomalies and actions"), series, expected)


def _panel_labels(target: dict) -> set[str]:
    """Label names a target filters on (its matchers) and names in its legend."""
    matchers = {m.split("=")[0].strip(" !~") for b in LABEL_MATCHERS.findall(target["expr"])
                for m in b.strip("{}").split(",") if m}  # fmt: skip
    return matchers | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))


def test_gpu_panels_use_the_labels_a_ranks_gpu_series_carry_in_both_modes():
    """Embedded, a rank's Prometheus sink exports its GPU readings; in sidecar mode the agent
    exports them as the owning rank's series (SeriesBook source (run, rank)). Either way the
    GPU panels' matchers and legends name labels the series carry."""
    from tests.unit.test_sinks import _gpu_power_batch
    from trainspec.agent.exposition import SeriesBook
    from trainspec.collector.sinks.prometheus import PrometheusSink

    catalogue = load_catalogue()
    resource = {"service.name": "svc", "trainspec.run.id": "r1", "host.name": "h",
                "trainspec.rank": 3, "trainspec.local_rank": 1, "trainspec.world_size": 4}  # fmt: skip
    assert set(resource) == set(catalogue.resource_attributes)
    sink = PrometheusSink({k: str(v) for k, v in resource.items()}, catalogue=catalogue)
    sink.write(_gpu_power_batch())
    embedded = sink.state.families()
    sink.close()
    book = SeriesBook(catalogue)
    book.apply_batch(("r1", 3), resource, _gpu_power_batch())
    sidecar = book.families()
    gpu_targets = [t for p in _dashboard()["panels"] if p["title"].startswith("GPU ")
                   for t in p["targets"]]  # fmt: skip
    assert len(gpu_targets) == 3
    checked = 0
    for families in (embedded, sidecar):
        for target in gpu_targets:  # the batch holds power readings only
            names = _metric_names(target["expr"])
            series = [s for f in families for s in f.samples if s.name in names]
            checked += len(series)
            for sample in series:
                assert _panel_labels(target) <= set(sample.labels), (target, sample.labels)
                assert sample.labels["trainspec_run_id"] == "r1"
                assert sample.labels["trainspec_rank"] == "3"
    assert checked == 6  # three GPUs, each mode
