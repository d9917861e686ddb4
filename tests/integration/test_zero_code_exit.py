"""`trainspec run -- torchrun ...`: how an unmodified script ends is on record. A script that
left mid-step through `sys.exit(1)` (no `sys.excepthook` sees a `SystemExit`), or
`os._exit(3)` (no atexit handler runs), or raised with its own `sys.excepthook` in place of
trainspec's, recorded nothing: the step it was in was neither stored nor failed, and
`trainspec validate` could not tell it from a killed rank's lost step. The failed job as a
whole is on record too: the launcher's `job_failed` event, with no rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import free_port
from tests.integration.test_zero_code import job_env, trainspec_run
from trainspec.store.compliance import validate_target

SCRIPT = Path(__file__).parent / "scripts" / "zero_code_exit.py"


def run_until_it_ends(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`trainspec run -- torchrun` (2 ranks) of scripts/zero_code_exit.py MODE, ending as it
    does; the process and its run directory."""
    cmd = [*trainspec_run(tmp_path, mode), sys.executable, "-m", "torch.distributed.run",
           "--standalone", "--nproc-per-node=2", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(SCRIPT), mode]  # fmt: skip
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=200)
    return proc, tmp_path / mode


def per_rank(run_dir: Path) -> tuple[list[tuple], list[tuple]]:
    """Each rank's stored steps, and its `step_failed` events (step, reason)."""
    con = store.open(run_dir)
    steps = con.execute("SELECT rank, list(step ORDER BY step) FROM steps GROUP BY rank "
                        "ORDER BY rank").fetchall()  # fmt: skip
    failed = con.execute("SELECT rank, step, reason FROM events WHERE name = 'step_failed' "
                         "ORDER BY rank, step").fetchall()  # fmt: skip
    return steps, failed


def job_failures(run_dir: Path) -> list[tuple]:
    """The launcher's `job_failed` events: rank, step, and the evidence's exit code."""
    sql = "SELECT rank, step, evidence FROM events WHERE name = 'job_failed' ORDER BY ts"
    rows = store.query(run_dir, sql).to_pylist()
    return [(r["rank"], r["step"], {"exit_code": json.loads(r["evidence"])["exit_code"]})
            for r in rows]  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("exit1", "SystemExit: 1"),
        ("hook", "RuntimeError: boom"),
        ("osexit3", "HardExit: os._exit(3)"),
    ],
)
def test_a_script_that_ends_mid_step_has_that_step_failed(tmp_path, mode, reason):
    """Both ranks end at step 3, after its backward: steps 0-2 are stored, step 3 failed,
    once (the script's own hook still prints the exception, and only it). After `os._exit`
    no atexit handler runs: the layer's own wrapper stored and closed, and each rank still
    exits with 3, as torchrun reports it."""
    proc, run_dir = run_until_it_ends(tmp_path, mode)
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's: a rank failed
    if mode == "hook":
        assert proc.stderr.count("their hook: RuntimeError: boom") == 2, proc.stderr[-3000:]
    if mode == "osexit3":
        assert len(re.findall(r"exitcode\s+:\s*3\b", proc.stderr)) == 2, proc.stderr[-3000:]
    assert per_rank(run_dir) == (
        [(0, [0, 1, 2]), (1, [0, 1, 2])],
        [(0, 3, reason), (1, 3, reason)],
    )
    # the launcher's word on the job as a whole: torchrun's status, at the step it ended in
    assert job_failures(run_dir) == [(None, 3, {"exit_code": 1})]
    report = validate_target(str(run_dir))  # (cadence on a loaded host is none of this test's)
    assert not [v for v in report.violations if v.metric == "events" or v.rank is None], report
    assert not [w for w in report.warnings if "no row for" in w], report.warnings


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["exit0", "caught"])
def test_a_clean_exit_or_a_caught_one_records_no_failure(tmp_path, mode):
    """`sys.exit(0)` after the last step, its process group left standing; a `sys.exit(1)`
    the script catches mid-step, training on: every step stored, none failed."""
    proc, run_dir = run_until_it_ends(tmp_path, mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    assert proc.stdout.count("caught exit 1") == (2 if mode == "caught" else 0), proc.stdout
    assert per_rank(run_dir) == ([(0, list(range(6))), (1, list(range(6)))], [])
    assert job_failures(run_dir) == []
