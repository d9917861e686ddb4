"""A 2-rank torchrun job on the explicit API with no `phase()` blocks passes `trainspec
validate`: its forward, backward and optimizer phases come from the hooks `wrap` puts on
the DDP model and the optimizer (or, with no optimizer given, torch's global optimizer
hooks). They were empty on every row, three required metrics violated on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.store.compliance import validate_target

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "no_phases.py"
STEPS = 60  # 480 samples, 2 ranks' loaders each reading all of them in batches of 8
COUNTS = (
    "SELECT rank, count(*), count(forward_s), count(backward_s), count(optimizer_s), "
    "count(grad_norm), bool_and(forward_s > 0 AND backward_s > 0 AND optimizer_s > 0) "
    "FROM steps GROUP BY rank ORDER BY rank"
)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["given", "bare"], ids=["optimizer", "no-optimizer"])
def test_a_job_without_phase_blocks_is_compliant(tmp_path, how):
    proc = torchrun(tmp_path, "nophases", script=SCRIPT, script_args=[how], timeout_s=150)
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    report = validate_target(tmp_path / "nophases")
    assert report.compliant, report.render_text()
    con = store.open(tmp_path / "nophases")
    full = (STEPS, STEPS, STEPS, STEPS, STEPS, True)
    assert con.execute(COUNTS).fetchall() == [(0, *full), (1, *full)]


@pytest.mark.timeout(200)
def test_under_trainspec_run_the_script_s_own_steps_are_timed_once(tmp_path):
    """The zero-code layer stands down for a script that starts trainspec itself; the
    script's `wrap` times its steps, and only those are stored."""
    launcher = [sys.executable, "-m", "trainspec.cli.main", "run", "--out", str(tmp_path),
                "--run-id", "both", "--"]  # fmt: skip
    torchrun(tmp_path, "ignored", script=SCRIPT, script_args=["bare"], launcher=launcher,
             timeout_s=150)  # fmt: skip
    report = validate_target(tmp_path / "both")
    assert report.compliant, report.render_text()
    con = store.open(tmp_path / "both")
    full = (STEPS, STEPS, STEPS, STEPS, STEPS, True)
    assert con.execute(COUNTS).fetchall() == [(0, *full), (1, *full)]
