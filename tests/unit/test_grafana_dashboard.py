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


def _input_series() -> list[dict[str, str]]:
    """Histogram `_sum` and `_count` series, as the Prometheus sink names them, growing by
    a constant amount per minute: rate(sum) / rate(count) is exactly the per-step mean."""
    series = []
    for rank, phases in PHASES.items():
        labels = f'{{trainspec_run_id="r1",trainspec_rank="{rank}"}}'
        for phase, seconds in phases.items():
            name = load_catalogue()[f"trainspec.step.{phase}"].prometheus_name
            per_minute = seconds * STEPS_PER_MINUTE
            series.append({"series": f"{name}_sum{labels}", "values": f"0+{per_minute}x20"})
            series.append({"series": f"{name}_count{labels}", "values": f"0+{STEPS_PER_MINUTE}x20"})
    return series


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.timeout(60)
def test_compute_panel_shows_the_straggler_not_the_rank_waiting_for_it(tmp_path):
    """The panel charted mean backward time, which includes the gradient-sync wait: the fast
    rank (0.5 s, waiting) looked slower than the straggler (0.4 s). promtool evaluates the
    committed query over series named as the exposition names them."""
    (panel,) = [p for p in _dashboard()["panels"] if p["title"].startswith("Compute per rank")]
    (target,) = panel["targets"]
    expr = target["expr"].replace("$__rate_interval", "5m").replace('=~"$run"', '=~".*"')
    expected = [
        {"labels": f'{{trainspec_rank="{rank}"}}',
         "value": round(p["forward"] + p["backward"] - p.get("comm_exposed", 0.0), 9)}
        for rank, p in PHASES.items()
    ]  # fmt: skip
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": _input_series(),
            "promql_expr_test": [{"expr": expr, "eval_time": "15m", "exp_samples": expected}],
        }],
    }  # fmt: skip
    path = tmp_path / "compute_test.yml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
