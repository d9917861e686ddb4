"""`trainspec validate` on OTLP payloads and Prometheus expositions that a QA sweep found judged
wrongly: series of two resources merged, a restarted process's counters read as going down,
ranks that are no whole number, non-finite timestamps, malformed OTLP histograms, notes that
failed `--strict`, and a node's own series charged with a rank's requirements."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers.payloads import prometheus_exposition
from tests.helpers.runs import synthetic_run
from trainspec.cli.main import main
from trainspec.schema.targets.model import TargetError, summarize
from trainspec.schema.targets.points import as_int
from trainspec.store.compliance import validate_target

T = 1_800_000_000_000_000_000  # ns
S = 10**9
SAMPLES = "trainspec.step.samples"
DROPPED = "trainspec.telemetry.dropped"  # a counter sampled every 1 s


def _resource(run="run-a", host="host-a", rank=None, world=None, local=None) -> dict:
    def kv(key, value):
        return {"key": key, "value": value}

    return {
        "attributes": [
            kv("service.name", {"stringValue": "trainspec"}),
            kv("trainspec.run.id", {"stringValue": run}),
            kv("host.name", {"stringValue": host}),
            kv("trainspec.rank", rank or {"intValue": "0"}),
            kv("trainspec.local_rank", local or {"intValue": "0"}),
            kv("trainspec.world_size", world or {"intValue": "1"}),
        ]
    }


def _counter(name: str, points: list[tuple[int, int, int]]) -> dict:
    """A cumulative monotonic sum: (start ns, time ns, value) points."""
    return {
        "name": name,
        "unit": "{sample}" if name == SAMPLES else "{point}",
        "sum": {
            "aggregationTemporality": 2,
            "isMonotonic": True,
            "dataPoints": [
                {"startTimeUnixNano": str(s), "timeUnixNano": str(t), "asInt": str(v)}
                for s, t, v in points
            ],
        },
    }


def _histogram(**point) -> dict:
    base = {
        "startTimeUnixNano": str(T),
        "timeUnixNano": str(T + S),
        "count": "6",
        "sum": 2.0,
        "explicitBounds": [0.1, 1.0],
        "bucketCounts": ["1", "2", "3"],
    }
    return {
        "name": "trainspec.step.duration",
        "unit": "s",
        "histogram": {"aggregationTemporality": 2, "dataPoints": [base | point]},
    }


def _payload(tmp_path, *resources: tuple[dict, list[dict]], name="p.json"):
    doc = {
        "resourceMetrics": [
            {"resource": r, "scopeMetrics": [{"scope": {"name": "t"}, "metrics": metrics}]}
            for r, metrics in resources
        ]
    }
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _rules(report) -> set[tuple[str, int | None, str]]:
    return {(v.metric, v.rank, v.rule) for v in report.violations}


def _of(report, rule: str) -> list:
    return [v for v in report.violations if v.rule == rule]


# ---------------------------------------------------------------- 1. series identity


def test_two_resources_claiming_one_rank_are_two_series(tmp_path):
    """Two runs' rank 0 in one payload were one series: 5000 then 16 read as going down."""
    target = _payload(
        tmp_path,
        (_resource("run-a", "host-a"), [_counter(SAMPLES, [(T, T + S, 5000)])]),
        (_resource("run-b", "host-b"), [_counter(SAMPLES, [(T, T + 2 * S, 16)])]),
    )
    report = validate_target(str(target))
    assert not _of(report, "monotonic"), report.render_text()
    assert report.series == 2


def test_a_violation_on_one_of_two_resources_says_which(tmp_path):
    target = _payload(
        tmp_path,
        (_resource("run-a", "host-a"), [_counter(SAMPLES, [(T, T + S, 10), (T, T + 2 * S, 20)])]),
        (_resource("run-b", "host-b"), [_counter(SAMPLES, [(T, T + S, 20), (T, T + 2 * S, 10)])]),
    )
    (down,) = _of(validate_target(str(target)), "monotonic")
    assert "trainspec.run.id=run-b" in down.evidence and "host.name=host-b" in down.evidence


def test_a_new_start_time_is_a_restart_not_a_drop(tmp_path):
    """OTLP marks a counter reset by a new start time: the restarted process counts from 0."""
    reset = [(T, T + S, 5000), (T + 3 * S // 2, T + 2 * S, 16)]
    report = validate_target(str(_payload(tmp_path, (_resource(), [_counter(SAMPLES, reset)]))))
    assert not _of(report, "monotonic"), report.render_text()
    # The same start time: a real drop.
    drop = [(T, T + S, 5000), (T, T + 2 * S, 16)]
    report = validate_target(str(_payload(tmp_path, (_resource(), [_counter(SAMPLES, drop)]))))
    assert (SAMPLES, 0, "monotonic") in _rules(report)
    # A start time that moved but overlaps the previous point is no restart either.
    overlap = [(T, T + 2 * S, 5000), (T + S, T + 3 * S, 16)]
    report = validate_target(str(_payload(tmp_path, (_resource(), [_counter(SAMPLES, overlap)]))))
    assert (SAMPLES, 0, "monotonic") in _rules(report)


def test_a_restart_is_no_cadence_gap(tmp_path):
    """A process restarted 20 s later: the gap between its two streams is no cadence gap
    (as in a stored run, judged per process); a gap inside one stream still is."""
    first = [(T, T + i * S, i) for i in range(1, 5)]
    second = [(T + 20 * S, T + (20 + i) * S, i) for i in range(1, 5)]
    target = _payload(tmp_path, (_resource(), [_counter(DROPPED, first + second)]))
    assert not _of(validate_target(str(target)), "cadence")
    one_stream = [(T, t, v) for _, t, v in first + second]
    target = _payload(tmp_path, (_resource(), [_counter(DROPPED, one_stream)]))
    assert (DROPPED, 0, "cadence") in _rules(validate_target(str(target)))


# ---------------------------------------------------------------- 2, 3. whole-number ranks


@pytest.mark.parametrize(
    ("attr", "value", "shown"),
    [
        ("rank", {"doubleValue": "Infinity"}, "inf"),  # int() raised OverflowError: exit 2
        ("rank", {"doubleValue": "NaN"}, "nan"),
        ("rank", {"doubleValue": 0.5}, "0.5"),  # int() made it rank 0
        ("rank", {"boolValue": True}, "True"),  # and this rank 1
        ("world", {"doubleValue": 2.5}, "2.5"),
        ("local", {"doubleValue": 0.7}, "0.7"),
        ("world", {"boolValue": True}, "True"),
    ],
)
def test_a_rank_or_world_size_that_is_no_whole_number_is_a_violation(
    tmp_path, capsys, attr, value, shown
):
    resource = _resource(**{attr: value})
    target = _payload(tmp_path, (resource, [_counter(SAMPLES, [(T, T + S, 5)])]))
    assert main(["validate", "--json", str(target)]) == 1
    doc = json.loads(capsys.readouterr().out)
    evidence = [v["evidence"] for v in doc["violations"] if v["rule"] == "resource-attribute"]
    name = {"rank": "trainspec.rank", "world": "trainspec.world_size"}.get(
        attr, "trainspec.local_rank"
    )
    assert [e for e in evidence if e.startswith(f"{name} is {shown}, ") and "not an integer" in e]
    if attr == "rank":
        assert doc["ranks"] == [None]  # judged as no rank, not as rank 0 or 1


def test_as_int_takes_whole_numbers_only():
    assert [as_int(v) for v in (3, 2.0, "4", " 5 ", "+6", "-1")] == [3, 2, 4, 5, 6, -1]
    bad = (True, False, 0.5, math.nan, math.inf, -math.inf, "1.0", "abc", "", None, [1], "9" * 5000)
    assert [as_int(v) for v in bad] == [None] * len(bad)


# ---------------------------------------------------------------- 4. Prometheus timestamps

_RSS = (
    'trainspec_process_memory_rss_bytes{host_name="h",service_name="s",'
    'trainspec_local_rank="0",trainspec_rank="0",trainspec_run_id="r",trainspec_world_size="1"}'
)
_GAP = (
    "# TYPE trainspec_process_memory_rss_bytes gauge\n"
    f"{_RSS} 5 1700000000000\n{_RSS} 6 1700000005000\n"
)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (_GAP + f"{_RSS} 7 NaN\n", 4),  # hid the 5 s gap above: the verdict passed cadence
        ("# TYPE trainspec_process_memory_rss_bytes gauge\n" + f"{_RSS} 5 +Inf\n", 2),
        ("# TYPE trainspec_process_memory_rss_bytes gauge\n" + f"{_RSS} 5 -Inf\n", 2),
    ],
)
def test_a_non_finite_timestamp_is_unparsable_naming_the_line(tmp_path, capsys, text, line):
    target = tmp_path / "m.prom"
    target.write_text(_GAP)
    assert main(["validate", str(target)]) == 1  # the gap alone: a cadence violation
    assert "[cadence]" in capsys.readouterr().out
    target.write_text(text)
    assert main(["validate", str(target)]) == 2  # promtool: "expected integer as timestamp"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"line {line}: trainspec_process_memory_rss_bytes has timestamp" in err, err


def test_summarize_leaves_non_finite_times_out_of_the_gaps():
    stats = summarize("m", 0, {}, [(0.0, 1.0), (5.0, 1.0), (math.nan, 1.0)], cumulative=False)
    assert (stats.p95_gap_s, stats.max_gap_s, stats.untimed) == (5.0, 5.0, 1)
    stats = summarize("m", 0, {}, [(math.inf, 1.0), (-math.inf, 1.0)], cumulative=False)
    assert stats.p95_gap_s is None and stats.untimed == 2


# ---------------------------------------------------------------- 5. OTLP histograms


@pytest.mark.parametrize(
    ("point", "fault"),
    [
        ({"bucketCounts": ["6"]}, "has 1 bucket count for 2 bounds (needs 3)"),
        ({"count": "600"}, "has count 600 but its bucket counts sum to 6"),
        ({"explicitBounds": [1.0, 0.1]}, "bucket bounds that do not increase (1 then 0.1)"),
        ({"explicitBounds": [0.1, 0.1]}, "bucket bounds that do not increase (0.1 then 0.1)"),
        ({"explicitBounds": [0.1, "NaN"]}, "has a NaN bucket bound"),
        ({"bucketCounts": [], "count": "6"}, "has 0 bucket counts for 2 bounds (needs 3)"),
    ],
)
def test_a_malformed_otlp_histogram_exits_2_naming_the_metric(tmp_path, capsys, point, fault):
    """The Prometheus reader refused the same faults; OTLP ones were judged compliant."""
    target = _payload(tmp_path, (_resource(), [_histogram(**point)]))
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "malformed OTLP histogram: trainspec.step.duration data point" in err, err
    assert fault in err, err


def test_an_otlp_histogram_with_a_nan_max_breaks_finite(tmp_path):
    ok = validate_target(str(_payload(tmp_path, (_resource(), [_histogram()]))))
    assert not _of(ok, "finite")
    for field in ("max", "min"):
        target = _payload(tmp_path, (_resource(), [_histogram(**{field: "NaN"})]))
        assert ("trainspec.step.duration", 0, "finite") in _rules(validate_target(str(target)))
    target = _payload(tmp_path, (_resource(), [_histogram(bucketCounts=[], explicitBounds=[])]))
    with pytest.raises(TargetError, match="has no bucket counts"):  # a wire fault since
        validate_target(str(target))  # tests/unit/test_validate_coverage_sweep.py


# ---------------------------------------------------------------- 6. --strict and notes


def test_strict_passes_a_compliant_scrape_and_still_prints_its_notes(tmp_path, capsys):
    """A scrape never carries timestamps, and an agent's endpoint always has its own
    metrics: both said so in warnings, so `--strict` could never pass either."""
    text = prometheus_exposition(synthetic_run(2, 1.0, False)).decode()
    text += (
        "# HELP trainspec_agent_requests_total Requests received.\n"
        "# TYPE trainspec_agent_requests_total counter\n"
        'trainspec_agent_requests_total{path="otlp"} 12\n'
    )
    target = tmp_path / "agent.prom"
    target.write_text(text)
    assert main(["validate", "--strict", str(target)]) == 0
    out = capsys.readouterr().out
    assert "note: cadence not judged: the points carry no timestamps" in out
    assert "note: not judged: 1 metric(s) of a component's own" in out
    assert "warning" not in out
    assert main(["validate", "--strict", "--json", str(target)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["passed"], doc["warnings"], len(doc["notes"])) == (True, [], 2)


def test_strict_passes_a_single_otlp_export(tmp_path):
    from tests.helpers.payloads import write_single_export

    assert main(["validate", "--strict", str(write_single_export(tmp_path / "one.pb"))]) == 0


# ---------------------------------------------------------------- 7. a node's own series

_NODE = (
    "# TYPE trainspec_host_cpu_utilization_ratio gauge\n"
    'trainspec_host_cpu_utilization_ratio{host_name="vm",service_name="trainspec-agent"} 1.0\n'
    "# TYPE trainspec_host_memory_used_bytes gauge\n"
    'trainspec_host_memory_used_bytes{host_name="vm",service_name="trainspec-agent"} 2.6e+09\n'
    "# TYPE trainspec_agent_store_rows_total counter\n"
    "trainspec_agent_store_rows_total 0.0\n"
)


def test_a_node_only_exposition_is_judged_as_a_node(tmp_path, capsys):
    """An idle agent's /metrics: 12 `required` violations were charged to rank `?`."""
    target = tmp_path / "idle.prom"
    target.write_text(_NODE)
    assert main(["validate", "--strict", str(target)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "ranks none" in out and "note: no rank: judged as a node's own series" in out
    # Without service.name it is still judged: a node's series carry that much.
    target.write_text(_NODE.replace('service_name="trainspec-agent"', ""))
    report = validate_target(str(target))
    assert {v.evidence for v in report.violations} == {"resource lacks service.name"}


def test_a_rank_exposition_missing_its_rank_label_is_still_judged_as_a_rank(tmp_path):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    target = tmp_path / "m.prom"
    # The rank label gone, the run id kept: rank `?`, every rank's rule applies.
    target.write_text(re.sub(r'trainspec_rank="0",?', "", text).replace(",}", "}"))
    report = validate_target(str(target))
    assert report.ranks == [None]
    assert ("*", None, "resource-attribute") in _rules(report)
    # Rank and run id gone: a rank's own metrics (steps, process) are still no node's.
    target.write_text(
        re.sub(r'(trainspec_rank|trainspec_run_id)="[^"]*",?', "", text).replace(",}", "}")
    )
    report = validate_target(str(target))
    assert report.ranks == [None]
    evidence = {v.evidence for v in report.violations if v.rule == "resource-attribute"}
    assert {"resource lacks trainspec.rank", "resource lacks trainspec.run.id"} <= evidence
    # A node's series beside ranks' are the node's: they add no rank `?`. (Each sample in
    # its family: a family written twice is refused, as promtool refuses it.)
    merged = text
    for type_line, sample in zip(_NODE.splitlines()[::2], _NODE.splitlines()[1::2]):
        if type_line in merged:
            merged = merged.replace(type_line + "\n", type_line + "\n" + sample + "\n", 1)
        else:
            merged += type_line + "\n" + sample + "\n"
    target.write_text(merged)
    report = validate_target(str(target))
    assert report.ranks == [0] and report.compliant, report.render_text()
