"""A job `trainspec run` saw fail is on record in its run (`cli/job_exit.py`): one `fault`
event, `job_failed`, with no rank, appended beside what the ranks stored, read back by the
store, the validator and the dashboard (whose actions view failed on a NULL rank)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import trainspec.store as store
from tests.helpers.runs import T0, make_compliant_run
from trainspec.cli.job_exit import failure_words, record_job_failure
from trainspec.cli.main import main
from trainspec.dashboards.data import event_ranks, load_actions
from trainspec.store.compliance import validate_target

COUNTS = "SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM steps), " \
         "(SELECT count(*) FROM runs), (SELECT count(*) FROM events WHERE rank IS NOT NULL)"  # fmt: skip


def counts(run_dir: Path) -> tuple:
    con = store.open(run_dir)
    try:
        return con.execute(COUNTS).fetchone()
    finally:
        con.close()


def job_events(run_dir: Path) -> list[dict]:
    sql = "SELECT rank, step, kind, name, severity, reason, evidence FROM events " \
          "WHERE name = 'job_failed' ORDER BY ts"  # fmt: skip
    rows = store.query(run_dir, sql).to_pylist()
    for row in rows:
        row["evidence"] = json.loads(row["evidence"])
    return rows


def test_the_status_in_words():
    assert failure_words(1) == ("the job exited with code 1", {"exit_code": 1})
    assert failure_words(137) == (
        "the job exited with status 137 (SIGKILL)",
        {"exit_code": 137, "signal": "SIGKILL"},
    )
    assert failure_words(255) == ("the job exited with code 255", {"exit_code": 255})


def test_the_event_is_appended_and_the_run_still_validates(tmp_path):
    """Nothing stored is lost or rewritten; the event is the job's (rank NULL), at the last
    step a rank of this job stored, and `trainspec validate` finds nothing more to say."""
    run = make_compliant_run(tmp_path / "run", ranks=2)
    before = counts(run)
    assert validate_target(str(run)).violations == []
    steps = store.query(run, "SELECT max(step) AS last FROM steps").to_pylist()[0]["last"]
    record_job_failure(run, 1, started_at=T0 + 1.0, ended_at=T0 + 4.0)
    assert counts(run) == before
    (event,) = job_events(run)
    assert event["evidence"].pop("host")
    assert event == {
        "rank": None, "step": steps, "kind": "fault", "name": "job_failed",
        "severity": "error", "reason": "the job exited with code 1",
        "evidence": {"exit_code": 1, "started_at": T0 + 1.0},
    }  # fmt: skip
    assert validate_target(str(run)).violations == []
    store.compact(run)  # folded into run.duckdb with the rest
    assert [e["name"] for e in job_events(run / "run.duckdb")] == ["job_failed"]


def test_a_job_that_stored_no_step_has_its_failure_at_no_step(tmp_path):
    """A second job on the run (`--run-id`) that failed before its first step: the steps
    before it are an earlier job's."""
    run = make_compliant_run(tmp_path / "run", ranks=1)
    record_job_failure(run, 2, started_at=T0 + 3600.0)
    record_job_failure(run, 3, started_at=T0 + 7200.0)  # and a third: both kept
    assert [(e["step"], e["evidence"]["exit_code"]) for e in job_events(run)] == [
        (None, 2),
        (None, 3),
    ]


def test_the_dashboard_s_ranks_leave_a_job_s_null_rank_out(tmp_path):
    run = make_compliant_run(tmp_path / "run", ranks=2)
    record_job_failure(run, 1, started_at=T0)
    con = store.open(run)
    try:
        events = load_actions(con).events
    finally:
        con.close()
    ranks = {ev.name: event_ranks(ev.ranks) for ev in events.itertuples()}
    assert ranks == {"periodic": [0, 1], "job_failed": []}
    masked = np.ma.masked_array([0, 2, 5], mask=[False, False, True], dtype=np.int32)
    assert event_ranks(masked) == [0, 2] and event_ranks([None, 3]) == [3]


def test_trainspec_run_records_a_failed_job_in_the_run_it_adds_to(tmp_path, capsys):
    """A second job on a stored run (`--run-id`), killed: the run says so, and the last
    line counts this job's steps (none), not the run's."""
    make_compliant_run(tmp_path / "r", ranks=2)
    argv = ["run", "--out", str(tmp_path), "--run-id", "r", "--", "bash", "-c", "kill -9 $$"]
    assert main(argv) == 137
    (event,) = job_events(tmp_path / "r")
    assert (event["rank"], event["step"], event["evidence"]["signal"]) == (None, None, "SIGKILL")
    assert capsys.readouterr().err.strip().endswith(f"stored in {tmp_path / 'r'} (no steps)")


def test_a_job_that_succeeded_or_stored_nothing_gets_no_event(tmp_path):
    make_compliant_run(tmp_path / "ok", ranks=1)
    assert main(["run", "--out", str(tmp_path), "--run-id", "ok", "--", "true"]) == 0
    assert job_events(tmp_path / "ok") == []
    assert main(["run", "--out", str(tmp_path), "--run-id", "none", "--", "false"]) == 1
    assert not (tmp_path / "none").exists()
