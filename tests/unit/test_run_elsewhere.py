"""`trainspec run --run-id outer -- ... script.py` whose script starts trainspec itself with
`init(run_id="inner")`: the command's last line said "nothing stored for run outer (no
training step was seen ...)" while runs/inner held the steps."""

from __future__ import annotations

import trainspec
from tests.helpers.env import one_process
from tests.helpers.runs import synthetic_run, write_run
from trainspec.cli.run import summary_line


def _under_trainspec_run(monkeypatch, root, run_id: str) -> None:
    """The environment `trainspec run --out ROOT --run-id RUN_ID` gives the job."""
    one_process(monkeypatch)
    monkeypatch.setenv("TRAINSPEC_RUN_PID", "1")
    monkeypatch.setenv("TRAINSPEC_STORE_ROOT", str(root))
    monkeypatch.setenv("TRAINSPEC_STORE_RUN_ID", run_id)


def test_the_last_line_names_the_run_the_script_chose(tmp_path, monkeypatch):
    _under_trainspec_run(monkeypatch, tmp_path, "outer")
    ts = trainspec.init(run_root=tmp_path, run_id="inner")
    try:
        with ts.step(samples=4):
            pass
    finally:
        ts.close()
    line = summary_line("outer", tmp_path / "outer", sidecar=False)
    assert "nothing stored" not in line, line
    assert line.startswith("the script chose run id inner over outer: run inner stored in "), line
    assert "(1 step, 1 rank)" in line
    assert not (tmp_path / "outer").exists()  # the note is gone, and its directory with it


def test_a_run_stored_where_the_command_said_leaves_no_note(tmp_path, monkeypatch):
    _under_trainspec_run(monkeypatch, tmp_path, "outer")
    ts = trainspec.init()  # the run id and root from the environment
    try:
        with ts.step(samples=4):
            pass
    finally:
        ts.close()
    assert not [p for p in (tmp_path / "outer").iterdir() if p.name.startswith(".elsewhere")]
    line = summary_line("outer", tmp_path / "outer", sidecar=False)
    assert line == f"run outer stored in {tmp_path / 'outer'} (1 step, 1 rank)"


def test_a_run_with_nothing_stored_anywhere_still_says_so(tmp_path):
    write_run(tmp_path / "other", synthetic_run(1, 1.0))  # another job's run: not named
    line = summary_line("outer", tmp_path / "outer", sidecar=False)
    assert line.startswith("nothing stored for run outer"), line


def test_the_last_line_counts_a_step_run_again_after_a_restart_once(tmp_path):
    from tests.helpers.runs import synthetic_run, write_run
    from trainspec.cli.run import count_steps

    run = synthetic_run(2, 2.0, False)
    steps = len({r["step"] for r in run.steps})
    again = [dict(r, ts=r["ts"] + 100.0) for r in run.steps if r["step"] >= steps - 5]
    run.steps += again  # a torchrun restart resumed 5 steps back
    assert count_steps(write_run(tmp_path / "r", run)) == (steps, 2)


def test_a_job_added_to_a_run_counts_its_own_steps(tmp_path):
    """`trainspec run --run-id r` of a second job: its last line said the whole run's steps."""
    run = synthetic_run(2, 2.0, False)
    started = max(r["ts"] for r in run.steps) + 10.0  # the second job, after the first
    run.steps += [dict(r, ts=started + 1.0 + r["step"]) for r in run.steps if r["step"] < 3]
    run_dir = write_run(tmp_path / "r", run)
    line = summary_line("r", run_dir, sidecar=False, since=started)
    assert line == f"run r stored in {run_dir} (3 steps, 2 ranks)"
