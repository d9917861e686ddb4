"""`trainspec validate` on targets a third QA sweep found judged wrongly: required series that
start late or stop early, counters without `_total`, empty label values, bucket bounds below a
metric's range, OTLP points that start after they end or carry no buckets, ranks and world
sizes that are no integers in range or disagree, NaN in event evidence, and parse errors that
did not say where."""

from __future__ import annotations

import pytest

from tests.helpers.payloads import otlp_request, prometheus_exposition
from tests.helpers.runs import T0, synthetic_run, write_run
from tests.unit.test_validate_wire_faults import (
    DROPPED,
    SAMPLES,
    S,
    T,
    _counter,
    _histogram,
    _payload,
    _resource,
)
from trainspec.cli.main import main
from trainspec.schema.targets.model import TargetError
from trainspec.schema.validate import COVERAGE_TOLERANCE
from trainspec.store.compliance import validate_target

CPU = "trainspec.process.cpu.utilization"  # sampled every 0.05 s
LIMIT = "trainspec.host.memory.limit"  # sampled every 1 s
LOOP_START = T0 + 0.01  # the synthetic run's first step starts here (ends at T0 + 0.1)
_H = "trainspec_step_duration_seconds"


def _rules(report) -> set[tuple[str, int | None, str]]:
    return {(v.metric, v.rank, v.rule) for v in report.violations}


def _of(report, rule: str) -> list:
    return [v for v in report.violations if v.rule == rule]


def _exit_2(capsys, target, *expected: str) -> str:
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    return err


def _keep(run, metric: str, rank: int, keep) -> None:
    """Keep only the points of one series for which keep(ts) holds."""
    run.samples = [
        r for r in run.samples if r["metric"] != metric or r["rank"] != rank or keep(r["ts"])
    ]


# ---------------------------------------------------------------- 1. coverage at the edges


def _gap(evidence: str) -> float:
    """The seconds a coverage violation's evidence gives ("first point 0.19 s after ...")."""
    return float(evidence.split()[2])


@pytest.mark.parametrize(
    ("metric", "late_s", "fails"),
    [
        (CPU, 1.6, True),  # 32 intervals late
        (CPU, 1.15, True),  # past the 1 s floor
        (CPU, 0.6, False),  # 12 intervals, under the 1 s floor: one stall of a loaded host
        (CPU, 0.1, False),  # 2 intervals: the first tick, or a rate's second reading
        (LIMIT, 3.0, True),  # 3 intervals of 1 s
        (LIMIT, 2.0, False),
    ],
)
def test_a_series_that_starts_late_fails_coverage(tmp_path, metric, late_s, fails):
    """Its first point came long after the training loop began, and nothing judged the
    time before it: cadence counts only gaps between points."""
    run = synthetic_run(2, 5.0, False)
    _keep(run, metric, 1, lambda ts: ts >= T0 + late_s - 0.006)  # sampled +-5 ms
    report = validate_target(str(write_run(tmp_path / "run", run)))
    coverage = _of(report, "coverage")
    if not fails:
        assert not coverage, coverage
        return
    assert [(v.metric, v.rank) for v in coverage] == [(metric, 1)], report.violations
    (evidence,) = [v.evidence for v in coverage]
    assert evidence.startswith("first point ") and "after the start of its process's" in evidence
    assert late_s - (LOOP_START - T0) - 0.006 <= _gap(evidence) <= late_s, evidence
    assert f"x {COVERAGE_TOLERANCE}, at least 1 s) allowed" in evidence
    assert "\n" not in evidence


def test_a_series_that_stops_early_fails_coverage(tmp_path):
    run = synthetic_run(2, 4.0, False)
    _keep(run, CPU, 0, lambda ts: ts <= T0 + 2.0)
    report = validate_target(str(write_run(tmp_path / "run", run)))
    (violation,) = _of(report, "coverage")
    assert (violation.metric, violation.rank) == (CPU, 0)
    assert violation.evidence.startswith("last point ")
    assert "before the end of its process's training loop" in violation.evidence
    assert abs(_gap(violation.evidence) - 2.0) <= 0.006, violation.evidence  # 40 intervals


def test_a_series_whose_last_point_is_a_stall_early_passes(tmp_path):
    """The latency probe needs its peer, which may close first, and a loaded host stalls a
    50 ms sampler for a few intervals: its last point 0.3 s before the loop's end (a
    zero-code test's probe ended 0.139 s early) is no sampler that stopped."""
    run = synthetic_run(2, 3.0, False)
    _keep(run, CPU, 0, lambda ts: ts <= T0 + 2.7)
    assert not _of(validate_target(str(write_run(tmp_path / "run", run))), "coverage")


def test_a_gpu_series_names_the_gpu_whose_samples_stopped(tmp_path):
    run = synthetic_run(1, 3.0, True)
    _keep(run, "trainspec.gpu.power", 0, lambda ts: ts <= T0 + 1.0)
    (violation,) = _of(validate_target(str(write_run(tmp_path / "run", run))), "coverage")
    assert violation.metric == "trainspec.gpu.power"
    assert '"gpu.index": 0' in violation.evidence


def test_a_rank_that_ends_early_is_measured_against_its_own_end(tmp_path):
    """A rank whose data ran out (DDP's join) ends its loop and its series before its peers:
    judged against the job's end, every series of it would fail."""
    run = synthetic_run(2, 3.0, False)
    end = T0 + 1.5
    run.samples = [r for r in run.samples if r["rank"] == 0 or r["ts"] <= end + 0.03]
    run.steps = [r for r in run.steps if r["rank"] == 0 or r["ts"] <= end]
    run.events.append(
        dict(run.events[1], ts=end, step=14, kind="anomaly", name="uneven_inputs", reason="out")
    )
    report = validate_target(str(write_run(tmp_path / "run", run)))
    assert not report.violations, report.violations


def test_a_rank_restarted_covers_each_process_on_its_own(tmp_path):
    """The new process of a restarted rank is judged from its own first step: a series that
    its samplers took up again 1.5 s late there fails, one taken up at once passes."""
    run = synthetic_run(2, 6.0, False)
    died, back = T0 + 1.5, T0 + 2.8
    dead = lambda r: r["rank"] == 1 and died < r["ts"] < back  # noqa: E731
    run.samples = [r for r in run.samples if not dead(r)]
    run.steps = [r for r in run.steps if not dead(r)]
    for row in run.samples:
        if row["rank"] == 1 and row["metric"] == DROPPED and row["ts"] > died:
            row["value"] = 0.0  # its new process counts from 0
    run.runs.append({**run.runs[1], "started_at": back - 0.2})
    assert not validate_target(str(write_run(tmp_path / "ok", run))).violations
    _keep(run, CPU, 1, lambda ts: ts <= died or ts >= back + 1.5)
    (violation,) = validate_target(str(write_run(tmp_path / "late", run))).violations
    assert (violation.metric, violation.rank, violation.rule) == (CPU, 1, "coverage")


def test_an_otlp_series_that_starts_late_fails_coverage(tmp_path):
    run = synthetic_run(2, 3.0, False)
    target = tmp_path / "ok.pb"
    target.write_bytes(otlp_request(run).SerializeToString())
    assert not _of(validate_target(str(target)), "coverage")
    _keep(run, CPU, 0, lambda ts: ts >= T0 + 2.0)
    target.write_bytes(otlp_request(run).SerializeToString())
    (violation,) = _of(validate_target(str(target)), "coverage")
    assert (violation.metric, violation.rank) == (CPU, 0)
    assert "s after the start of its rank's points" in violation.evidence
    assert 2.0 <= _gap(violation.evidence) <= 2.06, violation.evidence


# ---------------------------------------------------------------- 2. names and empty labels


def test_a_counter_without_total_is_a_name_violation(tmp_path):
    """The text parser renames a counter's samples to end in _total: `trainspec_step_samples`
    passed as `trainspec_step_samples_total`."""
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    target = tmp_path / "m.prom"
    target.write_text(text.replace("trainspec_step_samples_total", "trainspec_step_samples"))
    (violation,) = validate_target(str(target)).violations
    assert (violation.metric, violation.rank, violation.rule) == (SAMPLES, 0, "name")
    assert violation.evidence == (
        "counter trainspec_step_samples lacks the _total suffix "
        "(the catalogue names it trainspec_step_samples_total)"
    )


def test_an_empty_label_value_counts_as_missing(tmp_path):
    text = prometheus_exposition(synthetic_run(1, 1.0, True)).decode()
    target = tmp_path / "m.prom"
    target.write_text(text.replace('gpu_index="0"', 'gpu_index=""', 1))
    (violation,) = validate_target(str(target)).violations
    assert (violation.metric, violation.rule) == ("trainspec.gpu.utilization", "attribute")
    assert violation.evidence.startswith("missing gpu.index (empty value) on series ")
    target.write_text(text.replace('host_name="testhost"', 'host_name=""'))
    evidence = {v.evidence for v in validate_target(str(target)).violations}
    assert evidence == {"resource lacks host.name (empty value)"}


def test_an_empty_otlp_attribute_value_counts_as_missing(tmp_path):
    resource = _resource()
    resource["attributes"][1]["value"] = {"stringValue": ""}  # trainspec.run.id
    gpu = {
        "name": "trainspec.gpu.temperature",
        "unit": "Cel",
        "gauge": {
            "dataPoints": [
                {
                    "timeUnixNano": str(T + S),
                    "asDouble": 60.0,
                    "attributes": [
                        {"key": "gpu.index", "value": {"intValue": "0"}},
                        {"key": "hw.id", "value": {"stringValue": ""}},
                    ],
                }
            ]
        },
    }
    report = validate_target(str(_payload(tmp_path, (resource, [gpu]))))
    evidence = {(v.rule, v.evidence.split(" on series")[0]) for v in report.violations}
    assert ("resource-attribute", "resource lacks trainspec.run.id (empty value)") in evidence
    assert ("attribute", "missing hw.id (empty value)") in evidence


# ---------------------------------------------------------------- 3. bucket bounds


def test_a_prometheus_bucket_bound_below_the_range_is_a_range_violation(tmp_path):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    lines = text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{_H}_bucket"))
    assert 'le="0.001"' in lines[at]
    lines[at] = lines[at].replace('le="0.001"', 'le="-1.0"')
    target = tmp_path / "m.prom"
    target.write_text("".join(lines))
    (violation,) = validate_target(str(target)).violations
    assert (violation.metric, violation.rule) == ("trainspec.step.duration", "range")
    assert violation.evidence.startswith("histogram bucket bound -1 < 0, below any value")


def test_an_otlp_bucket_bound_below_the_range_is_a_range_violation(tmp_path):
    ok = validate_target(str(_payload(tmp_path, (_resource(), [_histogram()]))))
    assert not _of(ok, "range")
    target = _payload(tmp_path, (_resource(), [_histogram(explicitBounds=[-0.5, 1.0])]))
    (violation,) = _of(validate_target(str(target)), "range")
    assert violation.evidence.startswith("histogram bucket bound -0.5 < 0")


# ---------------------------------------------------------------- 4. and 6. OTLP wire faults


@pytest.mark.parametrize("kind", ["sum", "histogram"])
def test_an_otlp_point_that_starts_after_its_time_exits_2(tmp_path, capsys, kind):
    if kind == "sum":
        metric = _counter(SAMPLES, [(T + 2 * S, T + S, 5)])
    else:
        metric = _histogram(startTimeUnixNano=str(T + 2 * S))
    target = _payload(tmp_path, (_resource(), [metric]))
    _exit_2(
        capsys,
        target,
        f"malformed OTLP {kind}: ",
        f"data point has start_time_unix_nano {T + 2 * S} after its time_unix_nano {T + S}",
    )


def test_an_otlp_histogram_point_with_no_bucket_counts_exits_2(tmp_path, capsys):
    target = _payload(tmp_path, (_resource(), [_histogram(bucketCounts=[], explicitBounds=[])]))
    _exit_2(capsys, target, "trainspec.step.duration data point has no bucket counts")


# ---------------------------------------------------------------- 5. rank and world size


@pytest.mark.parametrize(
    ("attr", "value", "evidence"),
    [
        ("rank", {"doubleValue": 1.0}, "trainspec.rank is 1.0, a double, not an integer"),
        ("rank", {"stringValue": "+1"}, "trainspec.rank is '+1', not an integer in plain"),
        ("rank", {"stringValue": "01"}, "trainspec.rank is '01', not an integer in plain"),
        ("rank", {"intValue": "-1"}, "trainspec.rank is -1, below 0 (a rank counts from 0)"),
        ("world", {"intValue": "0"}, "trainspec.world_size is 0, below 1 (a world holds"),
        ("world", {"arrayValue": {}}, "trainspec.world_size is [], an array, not an integer"),
        ("local", {"intValue": "1"}, "trainspec.local_rank 1 is not below world size 1"),
    ],
)
def test_a_rank_or_world_size_out_of_place_says_what_is_wrong(tmp_path, attr, value, evidence):
    resource = _resource(**{attr: value})
    target = _payload(tmp_path, (resource, [_counter(SAMPLES, [(T, T + S, 5)])]))
    found = [v.evidence for v in _of(validate_target(str(target)), "resource-attribute")]
    assert [e for e in found if e.startswith(evidence)], found


def test_one_world_size_across_a_runs_series(tmp_path):
    two = {"intValue": "2"}
    target = _payload(
        tmp_path,
        (_resource(world=two), [_counter(SAMPLES, [(T, T + S, 5)])]),
        (_resource(rank={"intValue": "1"}, world={"intValue": "3"}), [_counter(SAMPLES, [(T, T + S, 5)])]),
    )  # fmt: skip
    found = [v.evidence for v in _of(validate_target(str(target)), "resource-attribute")]
    assert found == [
        "trainspec.world_size differs across the series of run 'run-a': 2 (rank 0), 3 (rank 1)"
    ]
    other_run = _payload(
        tmp_path,
        (_resource(world=two), [_counter(SAMPLES, [(T, T + S, 5)])]),
        (_resource("run-b", rank={"intValue": "1"}, world={"intValue": "3"}), [_counter(SAMPLES, [(T, T + S, 5)])]),
        name="two_runs.json",
    )  # fmt: skip
    assert not _of(validate_target(str(other_run)), "resource-attribute")


def test_a_runs_row_whose_rank_or_world_size_is_out_of_range(tmp_path):
    """A world size of 0 read as 1, a rank of -1 as a rank of its own, and a rank judged only
    against the largest world size any row declared."""
    run = synthetic_run(2, 1.0, False)
    run.runs[1]["world_size"] = 0
    report = validate_target(str(write_run(tmp_path / "zero", run)))
    assert [v.evidence for v in _of(report, "resource-attribute")] == [
        "runs row of rank 1: world_size is 0, below 1 (a world holds at least one rank)"
    ]
    run = synthetic_run(3, 1.0, False)
    run.runs[2]["world_size"] = 2  # rank 2 of a world of 2, while its peers say 3
    report = validate_target(str(write_run(tmp_path / "own", run)))
    assert [(v.rank, v.evidence) for v in _of(report, "resource-attribute")] == [
        (2, "runs row of rank 2: rank 2 is not below world size 2 (its own row's)")
    ]
    run = synthetic_run(1, 1.0, False)
    for table in (run.samples, run.steps, run.events, run.runs):
        for row in table:
            row["rank"] = -1
    report = validate_target(str(write_run(tmp_path / "negative", run)))
    assert "runs row of rank -1: rank is -1, below 0 (a rank counts from 0)" in {
        v.evidence for v in _of(report, "resource-attribute")
    }


# ---------------------------------------------------------------- 6. events and parse errors


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_event_evidence_is_a_warning_strict_fails(tmp_path, constant):
    """Strict readers refuse a bare NaN; trainspec's writer wrote them until 2026-11-28, so a
    run stored then stays compliant, warned, and `--strict` fails it."""
    run = synthetic_run(1, 1.0, False)
    text = f'{{"duration_s": {constant}}}'
    run.events[0]["evidence"] = text
    run.events.append(dict(run.events[0], step=run.events[0]["step"] + 1))
    report = validate_target(str(write_run(tmp_path / "run", run)))
    assert report.violations == [] and report.compliant
    assert report.warnings == [
        f"event checkpoint/periodic: evidence {text!r} is not strict JSON (holds {constant}) "
        "(and 1 more): strict readers refuse it"
    ]
    report.strict = True
    assert not report.passed


def test_evidence_that_is_no_json_is_a_violation(tmp_path):
    run = synthetic_run(1, 1.0, False)
    run.events[0]["evidence"] = '{"duration_s": '
    (violation,) = validate_target(str(write_run(tmp_path / "run", run))).violations
    assert (violation.metric, violation.rule) == ("events", "event")
    assert violation.evidence.endswith("is not JSON")


def test_an_exposition_the_parser_refuses_names_the_line(tmp_path, capsys):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    lines = text.splitlines(keepends=True)
    number = next(i for i, ln in enumerate(lines, 1) if ln.startswith("trainspec_step_samples"))
    bad = lines[number - 1].replace("{", "{{", 1)
    target = tmp_path / "bad.prom"
    target.write_text("".join(lines[: number - 1] + [bad] + lines[number:]))
    err = _exit_2(capsys, target, f"not a Prometheus exposition: line {number}: ")
    shown = err.split(f"line {number}: ", 1)[1]
    assert shown.startswith(repr(bad[:77] + "...")), err  # the line, cut at 80 characters
    with pytest.raises(TargetError, match=r"line 2: 'x\{ 1': "):
        validate_target(str(_write(tmp_path / "short.prom", "# TYPE x gauge\nx{ 1\n")))


def _write(path, text: str):
    path.write_text(text)
    return path
