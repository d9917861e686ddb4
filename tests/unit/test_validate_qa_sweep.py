"""`trainspec validate` on targets a second QA sweep found judged wrongly: Prometheus
histogram counts that are no count, CRLF line ends and families written twice (which
promtool refuses), summaries read as untyped duplicates, ranks outside their world size,
malformed OTLP points, and consecutive OTLP exports judged against a sampling interval an
export cannot show."""

from __future__ import annotations

import copy
import json

import pytest

from tests.helpers.payloads import otlp_json, otlp_request, prometheus_exposition
from tests.helpers.runs import synthetic_run, write_run
from trainspec.cli.main import main
from trainspec.store.compliance import validate_target

T = 1_800_000_000_000_000_000  # ns
S = 10**9
STEP = "trainspec.step.duration"
_H = "trainspec_step_duration_seconds"


def _rules(report) -> set[tuple[str, int | None, str]]:
    return {(v.metric, v.rank, v.rule) for v in report.violations}


def _exit_2(capsys, target, *expected: str) -> None:
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err


def _exposition(**buckets_and_count: str) -> str:
    """One step-duration histogram: buckets le=0.1 and +Inf, count and sum as given."""
    v = {"low": "1", "inf": "3", "count": "3", "sum": "0.6"} | buckets_and_count
    return (
        f"# TYPE {_H} histogram\n"
        f'{_H}_bucket{{le="0.1"}} {v["low"]}\n'
        f'{_H}_bucket{{le="+Inf"}} {v["inf"]}\n'
        f"{_H}_count {v['count']}\n"
        f"{_H}_sum {v['sum']}\n"
    )


# ---------------------------------------------------------------- Prometheus text


def test_a_histogram_count_is_a_whole_number_of_at_least_zero(tmp_path, capsys):
    """All-negative buckets and count passed as cumulative, and int() read a `_count` of
    34.7 as 34, equal to its +Inf bucket."""
    target = tmp_path / "h.prom"
    target.write_text(_exposition())
    assert validate_target(str(target)).kind == "prometheus"  # whole counts: read, judged
    target.write_text(_exposition(low="-5", inf="-5", count="-5", sum="-0.6"))
    _exit_2(capsys, target, f"{_H}_bucket is -5: a histogram count must be a whole number")
    target.write_text(_exposition(low="34", inf="34", count="34.7"))
    _exit_2(capsys, target, f"{_H}_count is 34.7: a histogram count must be a whole number")
    target.write_text(_exposition(low="1.5", inf="3", count="3"))
    _exit_2(capsys, target, f"{_H}_bucket is 1.5")


def test_crlf_line_ends_are_refused_as_promtool_refuses_them(tmp_path, capsys):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    target = tmp_path / "m.prom"
    target.write_text(text)
    assert main(["validate", str(target)]) == 0
    capsys.readouterr()
    target.write_bytes(text.replace("\n", "\r\n").encode())
    _exit_2(capsys, target, "not a Prometheus exposition: carriage return on line 1")
    lines = text.splitlines(keepends=True)
    target.write_bytes("".join(lines[:4] + [lines[4].replace("\n", "\r\n")] + lines[5:]).encode())
    _exit_2(capsys, target, "carriage return on line 5")


def test_a_family_written_twice_is_refused_as_promtool_refuses_it(tmp_path, capsys):
    """Two scrapes concatenated (or one family repeated) were compliant."""
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    target = tmp_path / "twice.prom"
    target.write_text(text + text)
    first = text.splitlines()[0].split()[2]
    line = len(text.splitlines()) + 1
    _exit_2(capsys, target, f"line {line}: second HELP line for metric name {first!r}")
    no_help = "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("# HELP"))
    target.write_text(no_help + no_help)
    _exit_2(capsys, target, "second TYPE line for metric name")


def test_a_summary_is_its_own_kind_not_an_untyped_duplicate(tmp_path):
    """A summary's _sum and _count read as two values of one untyped series: a false
    `duplicate`, and an instrument violation calling it "an untyped metric"."""
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    start = text.index(f"# HELP {_H} ")
    end = text.index("# HELP", start + 1)
    labels = text[start:end].split(f"{_H}_count", 1)[1].split(" ")[0]
    inner = labels[1:-1]
    summary = (
        f"# TYPE {_H} summary\n"
        f'{_H}{{{inner},quantile="0.5"}} 0.1\n'
        f'{_H}{{{inner},quantile="0.99"}} 0.3\n'
        f"{_H}_sum{labels} 10\n"
        f"{_H}_count{labels} 100\n"
    )
    target = tmp_path / "summary.prom"
    target.write_text(text[:start] + summary + text[end:])
    (violation,) = validate_target(str(target)).violations
    assert (violation.metric, violation.rule) == (STEP, "instrument")
    assert violation.evidence == f"{_H} is a summary, the catalogue says histogram"


@pytest.mark.parametrize(("rank", "world"), [("5", "2"), ("1", "1")])
def test_a_rank_outside_its_world_size_in_an_exposition(tmp_path, rank, world):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    target = tmp_path / "m.prom"
    target.write_text(
        text.replace('trainspec_rank="0"', f'trainspec_rank="{rank}"').replace(
            'trainspec_world_size="1"', f'trainspec_world_size="{world}"'
        )
    )
    report = validate_target(str(target))  # a world of 2 also requires distributed metrics
    (violation,) = [v for v in report.violations if v.rule == "resource-attribute"]
    assert violation.rank == int(rank)
    assert violation.evidence == f"rank {rank} is not below world size {world}"


# ---------------------------------------------------------------- stored runs


def test_a_rank_outside_its_world_size_in_a_run(tmp_path):
    """Rows of rank 5 added to a run of two: only "no row in the runs table" was warned."""
    run = synthetic_run(2, 1.0, False)
    assert validate_target(str(write_run(tmp_path / "ok", run))).compliant
    run.samples += [dict(r, rank=5) for r in run.samples if r["rank"] == 1]
    run.steps += [dict(r, rank=5) for r in run.steps if r["rank"] == 1]
    report = validate_target(str(write_run(tmp_path / "five", run)))
    outside = [v for v in report.violations if v.rule == "resource-attribute"]
    assert [(v.rank, v.evidence) for v in outside] == [(5, "rank 5 is not below world size 2")]


# ---------------------------------------------------------------- OTLP


def _resource(rank: str = "0", world: str = "1") -> dict:
    attrs = {
        "service.name": {"stringValue": "trainspec"},
        "trainspec.run.id": {"stringValue": "run-a"},
        "host.name": {"stringValue": "host-a"},
        "trainspec.rank": {"intValue": rank},
        "trainspec.local_rank": {"intValue": "0"},
        "trainspec.world_size": {"intValue": world},
    }
    return {"attributes": [{"key": k, "value": v} for k, v in attrs.items()]}


def _payload(tmp_path, metrics: list[dict], resource: dict | None = None):
    doc = {
        "resourceMetrics": [
            {
                "resource": resource or _resource(),
                "scopeMetrics": [{"scope": {"name": "t"}, "metrics": metrics}],
            }
        ]
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return path


def _histogram(temporality: int = 2, **point) -> dict:
    base = {
        "startTimeUnixNano": str(T),
        "timeUnixNano": str(T + S),
        "count": "6",
        "sum": 2.0,
        "min": 0.05,
        "max": 1.5,
        "explicitBounds": [0.1, 1.0],
        "bucketCounts": ["1", "2", "3"],
    }
    return {
        "name": STEP,
        "unit": "s",
        "histogram": {"aggregationTemporality": temporality, "dataPoints": [base | point]},
    }


def _gauge(time_ns: int) -> dict:
    return {
        "name": "trainspec.memory.pressure",
        "unit": "1",
        "gauge": {"dataPoints": [{"timeUnixNano": str(time_ns), "asDouble": 0.5}]},
    }


def test_an_otlp_histogram_whose_min_is_above_its_max_is_malformed(tmp_path, capsys):
    assert main(["validate", str(_payload(tmp_path, [_histogram()]))]) == 1  # judged
    capsys.readouterr()
    target = _payload(tmp_path, [_histogram(min=5.0, max=0.1)])
    _exit_2(
        capsys, target, f"malformed OTLP histogram: {STEP} data point has min 5 above its max 0.1"
    )


def test_an_unspecified_aggregation_temporality_is_malformed(tmp_path, capsys):
    """OTLP: AGGREGATION_TEMPORALITY_UNSPECIFIED "MUST NOT be used"; a counter with it passed."""
    _exit_2(capsys, _payload(tmp_path, [_histogram(temporality=0)]), "aggregation temporality 0")
    counter = {
        "name": "trainspec.telemetry.dropped",
        "unit": "{point}",
        "sum": {
            "aggregationTemporality": 0,
            "isMonotonic": True,
            "dataPoints": [{"startTimeUnixNano": str(T), "timeUnixNano": str(T + S), "asInt": "1"}],
        },
    }
    _exit_2(
        capsys,
        _payload(tmp_path, [counter]),
        "malformed OTLP sum: trainspec.telemetry.dropped data point has aggregation temporality 0",
    )


def test_an_otlp_point_without_a_time_is_a_time_violation(tmp_path):
    """time_unix_nano = 0 decoded as "no timestamp" and passed; a stored row without a
    time is a `time` violation, and so is it."""
    timed = validate_target(str(_payload(tmp_path, [_gauge(T)])))
    assert not [v for v in timed.violations if v.rule == "time"]
    report = validate_target(str(_payload(tmp_path, [_gauge(0)])))
    (untimed,) = [v for v in report.violations if v.rule == "time"]
    assert (untimed.metric, untimed.rank) == ("trainspec.memory.pressure", 0)
    assert "1 of 1 points have no finite time" in untimed.evidence


def _exports(count: int, interval_s: float, *, skip: tuple[int, str] | None = None):
    """`count` consecutive exports of one rank, as an SDK sends them: each series' last
    point, every point of one export stamped with its collection time."""
    run = synthetic_run(1, 1.0, False)
    last: dict = {}
    for r in run.samples:
        last[(r["metric"], r["attrs"])] = r
    requests = []
    for i in range(count):
        one = copy.deepcopy(run)
        at = run.steps[-1]["ts"] + i * interval_s
        one.samples = [
            dict(r, ts=at) for r in last.values() if skip is None or (i, r["metric"]) != skip
        ]
        one.steps = [dict(run.steps[-1], ts=at, step=run.steps[-1]["step"] + i)]
        requests.append(otlp_request(one))
    return requests


def test_consecutive_exports_are_judged_against_their_export_interval(tmp_path, capsys):
    """Three 1 s exports of one rank merged in one request failed cadence at a 1 s gap
    against the 0.05 s sampling interval, which one point per series per export cannot
    show. A series missing from an export still fails."""
    merged = _exports(3, 1.0)
    for extra in merged[1:]:
        merged[0].MergeFrom(extra)
    target = tmp_path / "merged.pb"
    target.write_bytes(merged[0].SerializeToString())
    assert main(["validate", "--strict", str(target)]) == 0
    assert "note: cadence judged against the export interval (1 s" in capsys.readouterr().out
    gapped = _exports(3, 1.0, skip=(1, "trainspec.memory.pressure"))
    for extra in gapped[1:]:
        gapped[0].MergeFrom(extra)
    target.write_bytes(gapped[0].SerializeToString())
    report = validate_target(str(target))
    assert _rules(report) == {("trainspec.memory.pressure", 0, "cadence")}
    (late,) = report.violations
    assert "(export interval 1 s x 1.5)" in late.evidence


def test_two_exports_leave_cadence_unjudged_with_a_note(tmp_path, capsys):
    """Two exports have one gap: the export interval, or an export an hour late. Judged
    against 0.05 s it failed every fast series; judged against itself it could never fail."""
    for interval_s in (1.0, 3600.0):
        two = _exports(2, interval_s)
        two[0].MergeFrom(two[1])
        target = tmp_path / "two.pb"
        target.write_bytes(two[0].SerializeToString())
        assert main(["validate", "--strict", str(target)]) == 0
        out = capsys.readouterr().out
        assert (
            "note: cadence not judged where the catalogue's interval is shorter than the one "
            in out
        )
        assert f"gap between two exports ({interval_s:g} s)" in out


def test_json_lines_of_requests_are_read(tmp_path, capsys):
    """The OpenTelemetry Collector's file exporter writes one request per line: refused as
    "Extra data: line 2"."""
    target = tmp_path / "collector.jsonl"
    lines = [otlp_json(r).decode().replace("\n", "") for r in _exports(2, 1.0)]
    target.write_text("\n".join(lines) + "\n")
    assert main(["validate", "--strict", str(target)]) == 0
    assert "COMPLIANT" in capsys.readouterr().out
    target.write_text(lines[0] + "\n{not json\n")
    _exit_2(capsys, target, "not an OTLP/JSON metrics request: JSON Lines request 2")
    target.write_text("{not json\n{not json either\n")
    _exit_2(capsys, target, "not an OTLP/JSON metrics request: Expecting property name")


def test_a_rank_outside_its_world_size_in_otlp(tmp_path):
    report = validate_target(str(_payload(tmp_path, [_gauge(T)], _resource("7", "2"))))
    outside = [v for v in report.violations if v.rule == "resource-attribute"]
    assert [(v.rank, v.evidence) for v in outside] == [(7, "rank 7 is not below world size 2")]


def test_json_lines_are_a_files_not_a_requests(tmp_path):
    """The agent decodes one OTLP/HTTP body: JSON Lines are read only from a file."""
    from trainspec.schema.targets import TargetError, decode_otlp

    lines = [otlp_json(r).decode().replace("\n", "") for r in _exports(2, 1.0)]
    body = ("\n".join(lines) + "\n").encode()
    assert len(decode_otlp(body, "application/json", json_lines=True)) > 0
    with pytest.raises(TargetError, match="Extra data: line 2"):
        decode_otlp(body, "application/json")
