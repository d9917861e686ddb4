"""`trainspec validate` on run directories and run.duckdb: compliant and broken runs."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.runs import break_run, synthetic_run, write_run
from trainspec.cli.main import main
from trainspec.schema.validate import CADENCE_TOLERANCE
from trainspec.store import compact
from trainspec.store.compliance import validate_target


def _write(tmp_path, name="run", ranks=2, gpus=False, seconds=2.0, **breaks):
    run = synthetic_run(ranks, seconds, gpus)
    if breaks:
        break_run(run, **breaks)
    return write_run(tmp_path / name, run, segments_per_rank=2)


def _rules(report) -> set[tuple[str, int | None, str]]:
    return {(v.metric, v.rank, v.rule) for v in report.violations}


@pytest.mark.parametrize(("ranks", "gpus"), [(1, False), (2, False), (2, True)])
def test_compliant_runs_pass(tmp_path, ranks, gpus, capsys):
    run_dir = _write(tmp_path, ranks=ranks, gpus=gpus)
    assert main(["validate", str(run_dir)]) == 0
    assert "COMPLIANT" in capsys.readouterr().out


def test_gpu_metrics_are_required_only_where_the_run_had_gpus(tmp_path):
    cpu = validate_target(str(_write(tmp_path, "cpu", drop_metric="trainspec.gpu.utilization")))
    assert cpu.compliant  # a CPU run never had it
    gpu = _write(tmp_path, "gpu", gpus=True, drop_metric="trainspec.gpu.utilization")
    assert {("trainspec.gpu.utilization", r, "required") for r in (0, 1)} <= _rules(
        validate_target(str(gpu))
    )


def test_distributed_metrics_are_required_only_with_more_than_one_rank(tmp_path):
    single = validate_target(str(_write(tmp_path, "one", ranks=1)))
    assert single.compliant  # no probe latency, no allreduce column on one rank
    two = validate_target(str(_write(tmp_path, "two", drop_metric="trainspec.comm.probe.latency")))
    assert ("trainspec.comm.probe.latency", 0, "required") in _rules(two)


def test_a_missing_rank_is_reported(tmp_path, capsys):
    run_dir = _write(tmp_path, ranks=3, drop_rank=1)
    assert main(["validate", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "rank 1  [rank-present]" in out
    assert ("*", 1, "rank-present") in _rules(validate_target(str(run_dir)))


def test_500ms_gaps_where_50ms_is_required_fail_cadence(tmp_path):
    metric = "trainspec.process.cpu.utilization"
    report = validate_target(str(_write(tmp_path, slow_metric=metric, slow_period_s=0.5)))
    cadence = [v for v in report.violations if v.rule == "cadence"]
    assert {(v.metric, v.rank) for v in cadence} == {(metric, 0), (metric, 1)}
    assert "p95 gap 0.5" in cadence[0].evidence
    assert f"x {CADENCE_TOLERANCE}" in cadence[0].evidence


def test_nan_counter_going_down_and_out_of_range_are_reported(tmp_path):
    report = validate_target(
        str(
            _write(
                tmp_path,
                nan_metric="trainspec.host.memory.used",
                counter_down="trainspec.telemetry.dropped",
                out_of_range="trainspec.memory.pressure",
            )
        )
    )
    rules = {(v.metric, v.rule) for v in report.violations}
    assert rules == {
        ("trainspec.host.memory.used", "finite"),
        ("trainspec.telemetry.dropped", "monotonic"),
        ("trainspec.memory.pressure", "range"),
    }


@pytest.mark.parametrize("bad_ts", [float("nan"), None])
def test_points_with_no_finite_time_are_reported(tmp_path, bad_ts):
    """A NaN or NULL ts made every gap unknown: cadence was never judged and the run passed
    `--strict`."""
    run = synthetic_run(2, 2.0, False)
    metric = "trainspec.process.cpu.utilization"
    for r in run.samples:
        if r["metric"] == metric and r["rank"] == 1:
            r["ts"] = bad_ts
    for r in run.steps:
        if r["rank"] == 0:
            r["ts"] = bad_ts
    report = validate_target(str(write_run(tmp_path / "run", run)))
    timed = {(v.metric, v.rank) for v in report.violations if v.rule == "time"}
    assert (metric, 1) in timed
    assert ("trainspec.step.duration", 0) in timed
    assert all(rank in (0, 1) for _, rank in timed)
    assert not any(rank == 0 and m == metric for m, rank in timed)


def test_malformed_events_and_unknown_names_are_reported(tmp_path):
    run = synthetic_run(1, 1.0, False)
    run.samples.append(
        {"ts": run.samples[0]["ts"], "rank": 0, "metric": "trainspec.made.up", "value": 1.0}
        | {"attrs": "{}"}
    )
    break_run(run, bad_event=True)
    report = validate_target(str(write_run(tmp_path / "run", run)))
    events = [v.evidence for v in report.violations if v.rule == "event"]
    assert len(events) == 3  # unknown kind, empty reason, evidence not JSON
    assert ("trainspec.made.up", 0, "name") in _rules(report)


def test_required_attribute_missing_from_samples_attrs(tmp_path):
    run = synthetic_run(1, 1.0, True)
    for r in run.samples:
        if r["metric"] == "trainspec.gpu.power":
            r["attrs"] = json.dumps({"gpu.index": 0})
    report = validate_target(str(write_run(tmp_path / "run", run)))
    (v,) = report.violations
    assert (v.metric, v.rule) == ("trainspec.gpu.power", "attribute") and "hw.id" in v.evidence


def test_json_output_lists_each_violation(tmp_path, capsys):
    run_dir = _write(tmp_path, ranks=2, drop_rank=1)
    assert main(["validate", "--json", str(run_dir)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["compliant"] is False and doc["kind"] == "run"
    assert {"metric": "*", "rank": 1, "rule": "rank-present"}.items() <= doc["violations"][
        0
    ].items()


def test_verdict_is_identical_before_and_after_compact(tmp_path):
    run_dir = _write(
        tmp_path, ranks=3, drop_rank=2, slow_metric="trainspec.host.cpu.utilization",
        nan_metric="trainspec.process.memory.rss",
    )  # fmt: skip
    before = validate_target(str(run_dir))
    target = compact(run_dir)
    after_file = validate_target(str(target))
    shutil.rmtree(run_dir / "segments")
    after_dir = validate_target(str(run_dir))  # a run dir holding only run.duckdb
    assert before.verdict() == after_file.verdict() == after_dir.verdict()
    assert len(before.violations) > 3


def test_corrupt_segment_is_a_warning_and_the_rest_is_judged(tmp_path, capsys):
    run_dir = _write(tmp_path, ranks=1)
    victim = sorted((run_dir / "segments" / "events").rglob("seg-*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:40])
    assert main(["validate", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "warning: segment skipped as unreadable" in out and victim.name in out
    assert main(["validate", "--strict", str(run_dir)]) == 1  # a CI gate: warnings fail
    out = capsys.readouterr().out
    assert "COMPLIANT, but --strict fails it on 1 warning" in out
    assert main(["validate", "--strict", "--json", str(run_dir)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["compliant"], doc["strict"], doc["passed"]) == (True, True, False)


def test_strict_passes_a_run_without_warnings(tmp_path, capsys):
    run_dir = _write(tmp_path, ranks=1)
    assert main(["validate", "--strict", str(run_dir)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("COMPLIANT")


@pytest.mark.parametrize("case", ["empty-dir", "missing", "garbage", "bad-duckdb", "empty-file"])
def test_unreadable_targets_exit_2_with_one_line(tmp_path, capsys, case):
    target = tmp_path / "t"
    if case == "empty-dir":
        target.mkdir()
    elif case == "garbage":
        target.write_bytes(bytes(range(256)) * 8)
    elif case == "bad-duckdb":
        target = tmp_path / "run.duckdb"
        target.write_bytes(b"not a database at all" * 100)
    elif case == "empty-file":
        target.write_bytes(b"")
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("trainspec validate: error:")
    assert str(target) in err


def test_validate_imports_neither_torch_nor_exporters(tmp_path):
    import subprocess
    import sys

    run_dir = _write(tmp_path, ranks=1, seconds=1.0)
    code = (
        "import sys; from trainspec.cli.main import main; rc = main(['validate', sys.argv[1]]); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'opentelemetry')]; "
        "sys.exit(rc or (3 if heavy else 0))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(run_dir)], timeout=60)
    assert result.returncode == 0


def _thin(run, metric: str, keep_every: int, inside: bool, loop_start: float) -> None:
    """Keep every `keep_every`-th point of `metric` before (or, `inside`, after) loop_start."""
    kept, i = [], 0
    for row in run.samples:
        if row["metric"] == metric and (row["ts"] >= loop_start) == inside:
            i += 1
            if i % keep_every:
                continue
        kept.append(row)
    run.samples = kept


@pytest.mark.parametrize("inside", [False, True])
def test_cadence_is_judged_over_the_training_loop_not_the_set_up_before_it(tmp_path, inside):
    from tests.helpers.runs import T0

    metric = "trainspec.process.cpu.utilization"
    run = synthetic_run(2, 2.0, False)
    loop_start = T0 + 1.0  # the script builds its model and data for the first second
    run.steps = [r for r in run.steps if r["ts"] - r["duration_s"] >= loop_start]
    _thin(run, metric, 5, inside, loop_start)  # 250 ms gaps, before the loop or in it
    report = validate_target(str(write_run(tmp_path / "run", run, segments_per_rank=2)))
    cadence = {(v.metric, v.rank) for v in report.violations if v.rule == "cadence"}
    assert cadence == ({(metric, 0), (metric, 1)} if inside else set()), report.violations


def test_a_noise_scale_that_is_undefined_is_not_a_violation_a_missing_variance_is(tmp_path):
    run = synthetic_run(2, 2.0, False)
    for i, row in enumerate(run.steps):
        row["grad_noise_scale"] = None  # the |G|^2 EMA never turned positive: no value exists
        if i % 2:
            row["grad_variance"] = None
    report = validate_target(str(write_run(tmp_path / "run", run, segments_per_rank=2)))
    assert {(m, rule) for m, _, rule in _rules(report)} == {("trainspec.grad.variance", "cadence")}


def test_a_sample_stored_twice_with_another_value_is_a_duplicate(tmp_path):
    import pyarrow as pa

    from trainspec.store import SegmentWriter, query

    run_dir = _write(tmp_path, ranks=1)
    metric = "trainspec.host.cpu.utilization"
    row = query(run_dir, f"SELECT * FROM samples WHERE metric = '{metric}' ORDER BY ts LIMIT 1")
    assert validate_target(str(run_dir)).compliant
    clash = row.set_column(row.schema.get_field_index("value"), "value", pa.array([0.123456]))
    SegmentWriter(run_dir, "samples", "late-writer").write(clash)
    assert (metric, 0, "duplicate") in _rules(validate_target(str(run_dir)))


def test_a_row_stored_twice_alike_is_not_a_duplicate_even_nan_or_null(tmp_path):
    """At-least-once delivery can store a batch twice: identical rows, NaN and NULL values
    among them, are not conflicting values."""
    import pyarrow as pa

    from trainspec.store import SegmentWriter, query

    run_dir = _write(tmp_path, ranks=1)
    metric = "trainspec.host.cpu.utilization"
    rows = query(run_dir, f"SELECT * FROM samples WHERE metric = '{metric}' ORDER BY ts LIMIT 3")
    values = pa.array([float("nan"), None, 0.5])
    odd = rows.set_column(rows.schema.get_field_index("value"), "value", values)
    shifted = pa.compute.add(odd.column("ts"), 0.0123)  # times of their own
    odd = odd.set_column(odd.schema.get_field_index("ts"), "ts", shifted)
    SegmentWriter(run_dir, "samples", "twice-a").write(odd)
    SegmentWriter(run_dir, "samples", "twice-b").write(odd)
    report = validate_target(str(run_dir))
    assert not any(rule == "duplicate" for _, _, rule in _rules(report))


def test_gradient_statistics_may_be_absent_only_on_steps_an_event_marks(tmp_path):
    """A step whose gradients were not finite has no norm or variance, and a
    nonfinite_gradients event on that step and rank says so: excused there, and only there."""
    run = synthetic_run(2, 2.0, False)
    marked = [r for r in run.steps if r["rank"] == 0][3]
    unmarked = [r for r in run.steps if r["rank"] == 1][5]
    for row in (marked, unmarked):
        row["grad_norm"] = row["grad_variance"] = row["grad_noise_scale"] = None
    event = dict(run.events[0]) if run.events else {}
    event.update(
        ts=marked["ts"], rank=0, step=marked["step"], kind="anomaly",
        name="nonfinite_gradients", reason="gradients not finite", severity="warning",
        evidence="{}", before=None, after=None,
    )  # fmt: skip
    run.events.append(event)
    report = validate_target(str(write_run(tmp_path / "run", run, segments_per_rank=2)))
    assert {(m, r, rule) for m, r, rule in _rules(report)} == {
        ("trainspec.grad.norm", 1, "cadence"),
        ("trainspec.grad.variance", 1, "cadence"),
    }


def test_steps_stored_twice_or_not_at_all_are_warnings_naming_the_ranges(tmp_path):
    """After a kill and a restart from a checkpoint the killed rank's unflushed rows were
    gone, and validate said nothing (recovery QA). Rows stored twice are said too, unless a
    `checkpoint loaded` event explains them: the earlier attempt's rows of the steps the
    restarted job ran again."""
    import json

    import pyarrow as pa
    import pyarrow.compute as pc

    from trainspec.store import SegmentWriter, query
    from trainspec.store.tables import EVENTS

    assert validate_target(str(_write(tmp_path, "whole"))).warnings == []
    run = synthetic_run(2, 2.0, False)
    run.steps = [r for r in run.steps if not (r["rank"] == 1 and r["step"] in (3, 4, 7))]
    failed = {**run.events[0], "rank": 1, "step": 7, "kind": "fault", "name": "step_failed"}
    run.events.append(failed)  # a step whose body raised keeps its number: not missing
    run_dir = write_run(tmp_path / "run", run, segments_per_rank=2)
    steps = query(run_dir, "SELECT * FROM steps WHERE rank = 0 ORDER BY step")
    last = steps.column("step")[-1].as_py()
    assert last >= 6
    again = steps.filter(pc.greater_equal(steps.column("step"), last - 2))  # the re-run
    again = again.set_column(0, "ts", pc.add(again.column("ts"), 100.0))
    SegmentWriter(run_dir, "steps", "attempt-1").write(again)
    missing = "rank 1: no row for steps 3-4 (rows a killed process had not flushed, or dropped)"
    report = validate_target(str(run_dir))
    assert report.warnings == [
        f"rank 0: stored more than once: steps {last - 2}-{last} (3 extra rows) (no checkpoint "
        "was loaded after the earlier rows: two jobs under one run id, or rows written twice)",
        missing,
    ]
    assert main(["validate", "--strict", str(run_dir)]) == 1
    loaded = {name: None for name in EVENTS.names} | {
        "ts": again.column("ts")[0].as_py() - 1.0, "rank": 0, "step": 0, "kind": "checkpoint",
        "name": "loaded", "severity": "info", "reason": "checkpoint loaded",
        "evidence": json.dumps({"step": last - 2}),
    }  # fmt: skip
    SegmentWriter(run_dir, "events", "attempt-1").write(pa.Table.from_pylist([loaded], EVENTS))
    assert validate_target(str(run_dir)).warnings == [missing]


@pytest.mark.parametrize("restarted", [True, False])
def test_a_rank_restarted_is_judged_per_process_not_across_its_restart(tmp_path, restarted):
    """Rank 1 dies at 1.5 s and its new process (a runs row of its own, torchrun
    --max-restarts) starts at 2.8 s: the gap between them is the restart, not a late sampler,
    and its counters start again from 0 (a reset, as Prometheus reads one). The same gap and
    fall with no new process are a cadence violation (of the 1 s series: a 1.3 s gap is 5% of
    a 50 ms series' gaps) and a monotonic one."""
    from tests.helpers.runs import T0

    run = synthetic_run(2, 4.0, False)
    died, back = T0 + 1.5, T0 + 2.8
    dead = lambda r: r["rank"] == 1 and died < r["ts"] < back  # noqa: E731
    run.samples = [r for r in run.samples if not dead(r)]
    run.steps = [r for r in run.steps if not dead(r)]
    counter = "trainspec.telemetry.dropped"
    for row in run.samples:
        if row["rank"] == 1 and row["metric"] == counter:
            row["value"] = 5.0 if row["ts"] <= died else 0.0  # counted, then reset
    if restarted:
        run.runs.append({**run.runs[1], "started_at": back - 0.2})
    report = validate_target(str(write_run(tmp_path / "run", run, segments_per_rank=2)))
    judged = {(m, rule) for m, rank, rule in _rules(report) if rank == 1}
    if restarted:
        assert judged == set(), report.violations
    else:
        assert (counter, "monotonic") in judged
        assert ("trainspec.host.memory.limit", "cadence") in judged  # 1 s: 4 points


def _measured_alone(run, *, process_group: bool | None):
    """A two-rank run whose ranks never communicated (no probe, no all-reduce, no gradient
    variance across ranks), each runs row saying whether the rank had a process group."""
    from trainspec.schema import load_catalogue

    distributed = [m for m in load_catalogue() if m.required_when == "distributed"]
    columns = {m.store_column for m in distributed if m.store_table == "steps"}
    names = {m.name for m in distributed}
    run.samples = [r for r in run.samples if r["metric"] not in names]
    for row in run.steps:
        row.update(dict.fromkeys(columns))
    if process_group is not None:
        for row in run.runs:
            row["config"] = json.dumps({"process_group": process_group})
    return run


def test_ranks_with_no_process_group_need_no_distributed_metrics_but_must_all_report(tmp_path):
    """Torchrun workers that make no group (`init(create_process_group=False)`, or a script
    under `trainspec run` that never makes one) failed validate on every run: probe latency,
    all-reduce time, exposed communication, gradient variance and bytes "required
    (distributed) but absent", though these ranks never talk to each other."""
    alone = _measured_alone(synthetic_run(2, 2.0), process_group=False)
    assert validate_target(str(write_run(tmp_path / "alone", alone))).compliant
    for said in (True, None):  # a group, or a row from before rows said: as before
        run = _measured_alone(synthetic_run(2, 2.0), process_group=said)
        report = validate_target(str(write_run(tmp_path / f"group-{said}", run)))
        assert ("trainspec.comm.probe.latency", 0, "required") in _rules(report)
        assert ("trainspec.grad.variance", 1, "required") in _rules(report)
    missing = break_run(_measured_alone(synthetic_run(3, 2.0), process_group=False), drop_rank=1)
    rules = _rules(validate_target(str(write_run(tmp_path / "missing", missing))))
    assert rules == {("*", 1, "rank-present")}  # every rank the world size promises


def test_a_rank_started_without_a_process_group_says_so_in_its_runs_row(tmp_path, monkeypatch):
    import trainspec
    import trainspec.store as store
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun worker of two, measured on its own
    ts = trainspec.init(run_root=tmp_path, run_id="alone", create_process_group=False)
    try:
        with ts.step(samples=4):
            pass
    finally:
        ts.close()
    (config,) = store.query(tmp_path / "alone", "SELECT config FROM runs").column("config")
    assert json.loads(config.as_py())["process_group"] is False
    report = validate_target(str(tmp_path / "alone"))
    assert not [
        v for v in report.violations if v.rule == "required" and "distributed" in v.evidence
    ]
    assert ("*", 0, "rank-present") in _rules(report)  # rank 0 never reported


def test_a_variance_across_ranks_may_be_absent_where_one_rank_trained_alone(tmp_path):
    """A step whose batch went to one rank (an epoch's remainder, shares [1, 0]) has no
    variance across ranks: a healthy run failed cadence on it. A variance missing where both
    ranks trained is still a violation."""
    run = synthetic_run(2, 2.0, False)
    for row in run.steps:
        if row["step"] == 5:
            row["grad_variance"] = row["grad_noise_scale"] = None
            row["samples"] = 0 if row["rank"] == 1 else 32
        if row["step"] == 9:
            row["grad_variance"] = None  # both ranks trained: no excuse
    report = validate_target(str(write_run(tmp_path / "run", run, segments_per_rank=2)))
    variance = [v for v in report.violations if v.metric == "trainspec.grad.variance"]
    assert {(v.rank, v.rule) for v in variance} == {(0, "cadence"), (1, "cadence")}
    assert all("no value on 1 of" in v.evidence for v in variance), variance


@pytest.mark.parametrize("restart", [1, 0])
def test_steps_a_restart_that_found_no_checkpoint_ran_again_are_expected(tmp_path, restart):
    """torchrun restarted rank 0's process before any checkpoint was committed: it ran steps
    0.. again, which was warned as "two jobs under one run id". A new process that torchrun
    did not restart (a second job under the same id) still is."""
    run = synthetic_run(2, 2.0, False)
    again = [dict(r, ts=r["ts"] + 100.0) for r in run.steps if r["rank"] == 0 and r["step"] < 7]
    run.steps += again
    config = json.dumps({"process_group": True, "restart": restart})
    run.runs.append({**run.runs[0], "started_at": again[0]["ts"] - 1.0, "config": config})
    warnings = validate_target(str(write_run(tmp_path / "run", run))).warnings
    twice = [w for w in warnings if "stored more than once" in w]
    assert twice == ([] if restart else [twice[0]]) and (restart or "steps 0-6" in twice[0])


def test_a_rank_whose_last_steps_are_missing_is_warned(tmp_path, capsys):
    """Rank 1 killed at step 24 with no restart stored steps 0-18 (its last rows lost even to
    its journal), rank 0 0-23: `--strict` passed, as the gap is at the end of rank 1's own
    steps. Ranks measured each on its own (no process group) need not end together."""
    run = synthetic_run(2, 2.0, False)
    last = max(r["step"] for r in run.steps)
    run.steps = [r for r in run.steps if not (r["rank"] == 1 and r["step"] > last - 4)]
    run_dir = write_run(tmp_path / "run", run)
    assert validate_target(str(run_dir)).warnings == [
        f"rank 1: no row for steps {last - 3}-{last}, which other ranks stored (the last rows "
        "of a process that was killed, or of a run still being written)"
    ]
    assert main(["validate", "--strict", str(run_dir)]) == 1
    for row in run.runs:
        row["config"] = json.dumps({"process_group": False})
    assert validate_target(str(write_run(tmp_path / "alone", run))).warnings == []


def test_a_repeat_before_a_restart_is_not_excused_by_it(tmp_path):
    """Rows stored twice within the first process (two jobs under one run id) stay a warning
    though a restart came later: only the restarted process's own re-runs are expected."""
    run = synthetic_run(2, 2.0, False)
    twice = [dict(r, ts=r["ts"] + 0.001) for r in run.steps if r["rank"] == 0 and r["step"] < 3]
    run.steps += twice
    last = max(r["ts"] for r in run.steps)
    config = json.dumps({"process_group": True, "restart": 1})
    run.runs.append({**run.runs[0], "started_at": last + 10.0, "config": config})
    warnings = validate_target(str(write_run(tmp_path / "run", run))).warnings
    assert any("rank 0: stored more than once: steps 0-2" in w for w in warnings), warnings


def test_a_rank_whose_first_steps_are_missing_is_warned(tmp_path, capsys):
    """Rank 1's first segment lost (steps 0-3), rank 0 stored 0..: `--strict` passed, as no
    gap lies between rank 1's own stored steps. A resumed job starts at the checkpoint's
    step on every rank (no warning), and ranks without a process group need not start
    together."""
    run = synthetic_run(2, 2.0, False)
    run.steps = [r for r in run.steps if not (r["rank"] == 1 and r["step"] < 4)]
    run_dir = write_run(tmp_path / "run", run)
    assert validate_target(str(run_dir)).warnings == [
        "rank 1: no row for steps 0-3, which other ranks stored before its first row (the "
        "first rows of a process lost or dropped)"
    ]
    assert main(["validate", "--strict", str(run_dir)]) == 1
    resumed = synthetic_run(2, 2.0, False)
    resumed.steps = [r for r in resumed.steps if r["step"] >= 4]
    assert validate_target(str(write_run(tmp_path / "resumed", resumed))).warnings == []
    for row in run.runs:
        row["config"] = json.dumps({"process_group": False})
    assert validate_target(str(write_run(tmp_path / "alone", run))).warnings == []


def test_ranks_that_joined_a_resumed_job_at_its_checkpoint_are_not_warned(tmp_path):
    """A job resumed under the same run id with more ranks (scaled up from 2 to 4) starts
    its new ranks at the checkpoint's step: each loaded it there, which is no lost head."""
    run = synthetic_run(4, 2.0, False)
    run.steps = [r for r in run.steps if not (r["rank"] >= 2 and r["step"] < 4)]
    warned = validate_target(str(write_run(tmp_path / "unexplained", run))).warnings
    assert [w.split(":")[0] for w in warned if "before its first row" in w] == [
        "rank 2",
        "rank 3",
    ]
    first = min(r["ts"] for r in run.steps if r["step"] == 4)
    for rank in (2, 3):
        run.events.append({"ts": first - 0.5, "rank": rank, "step": 4, "kind": "checkpoint",
                           "name": "loaded", "severity": "info", "reason": "resumed",
                           "evidence": json.dumps({"step": 4}), "before": None,
                           "after": None})  # fmt: skip
    warned = validate_target(str(write_run(tmp_path / "scaled", run))).warnings
    assert not [w for w in warned if "before its first row" in w], warned
