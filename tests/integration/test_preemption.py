"""A preemption notice (SIGTERM) in the reference job: checkpoint at the next step boundary,
on every rank alike, then a clean stop with everything measured flushed."""

from __future__ import annotations

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_then_stops_cleanly(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"TRAINSPEC_ALLOW_INJECT": "1", "TRAINSPEC_INJECT": "preempt:step=12"}
    torchrun(
        tmp_path, "pre", env=env, script_args=["--steps=60", "--batch-size=8", f"--ckpt-dir={ckpt}"]
    )
    con = store.open(tmp_path / "pre")
    last_steps = con.execute(
        "SELECT rank, max(step) FROM steps GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert all(12 <= s < 59 for _, s in last_steps), last_steps  # stopped early, both ranks
    events = con.execute(
        "SELECT DISTINCT rank FROM events WHERE kind = 'action' AND reason LIKE 'preemption%'"
    ).fetchall()
    assert sorted(r for (r,) in events) == [0, 1]
    newest = committed_newest_first(ckpt)
    assert newest, "no committed checkpoint after the preemption notice"


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_one_process_checkpoints_at_a_preemption_notice_and_resumes_from_it(tmp_path):
    """One process (a single-GPU job, no process group): `--ckpt-dir` was "unused in a single
    process", so a preempted job started again from step 0 (recovery QA)."""
    import os
    import subprocess
    import sys

    from tests.integration.jobs import SCRIPT

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRAINSPEC_STORE_ROOT=str(tmp_path),
               TRAINSPEC_ALLOW_INJECT="1", TRAINSPEC_INJECT="preempt:step=5")  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        env.pop(key, None)
    args = [sys.executable, str(SCRIPT), "--steps=12", "--batch-size=8", f"--ckpt-dir={ckpt}"]
    for run_id in ("first", "second"):
        env["TRAINSPEC_STORE_RUN_ID"] = run_id
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert [c.step for c in committed_newest_first(ckpt)][0] == 6  # before step 6 began
    spans = [store.query(tmp_path / r, "SELECT min(step) AS a, max(step) AS b FROM steps")
             .to_pylist()[0] for r in ("first", "second")]  # fmt: skip
    assert spans == [{"a": 0, "b": 5}, {"a": 6, "b": 11}]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_preemption_at_a_step_the_controller_saves_checkpoints_it_once(tmp_path):
    """SIGTERM at step 5 with 5-step windows: the controller's first checkpoint and the
    preemption save are of the same step 6. It was written twice (two `saved` events, dcp's
    "overwriting" warning), and a process killed during the second write left no
    loadable checkpoint (QA B2)."""
    ckpt = tmp_path / "ckpt"
    env = {"TRAINSPEC_ALLOW_INJECT": "1", "TRAINSPEC_INJECT": "preempt:step=5",
           "TRAINSPEC_ACTUATOR_WINDOW_STEPS": "5"}  # fmt: skip
    proc = torchrun(tmp_path, "pre", env=env, script_args=[
        "--steps=20", "--batch-size=8", "--max-bytes=300000", "--layers=1", "--embd=64",
        f"--ckpt-dir={ckpt}"])  # fmt: skip
    con = store.open(tmp_path / "pre")
    saved = con.execute(
        "SELECT rank, CAST(json_extract(evidence, '$.step') AS INTEGER) FROM events "
        "WHERE kind = 'checkpoint' AND name = 'saved'"
    ).fetchall()
    assert sorted(saved) == [(0, 6), (1, 6)], saved
    assert "overwriting" not in proc.stdout + proc.stderr
    assert [c.step for c in committed_newest_first(ckpt)] == [6]
