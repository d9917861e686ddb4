"""A restarted two-rank job (torchrun, gloo) goes on with the actuator state it had: the
compression level, each rank's micro-batch limit and OOM size, the shares, the controller's
hysteresis and the error feedback, so its next updates equal the uninterrupted job's bit for
bit. Before, `act.resume()` restored model, optimizer and sampler only: the resumed job ran
at the configured level and micro-batch, without its error feedback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first, extra_path, write_commit

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "actuator_state_resume.py"
ENV = {"TRAINSPEC_ACTUATOR_DRY_RUN": "1", "TRAINSPEC_ACTUATOR_WINDOW_STEPS": "2",
       "TRAINSPEC_COLLECTOR_PROBE": "0"}  # fmt: skip


def _reports(out: Path, phase: str) -> list[dict]:
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(400)
def test_a_resumed_job_goes_on_with_the_actuator_state_it_had(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    for phase in ("first", "resume"):
        torchrun(tmp_path / "runs", phase, script=SCRIPT, env=ENV,
                 script_args=[str(tmp_path), ckpt, phase], timeout_s=200)  # fmt: skip
    first, resumed = _reports(tmp_path, "first"), _reports(tmp_path, "resume")
    for rank, (saved, got) in enumerate(zip(first, resumed, strict=True)):
        assert got["first_step"] == 6
        mine = got["in_force"]
        assert mine["level"] == "int8", (rank, mine)
        assert (mine["limit"], mine["oom_at"]) == ((2, 4) if rank == 0 else (1, 2)), (rank, mine)
        assert mine["shares"] == [5, 3]
        # rank 0's controller state, on every rank, exactly as it was at the save
        assert mine["controller"] == first[0]["in_force"]["controller"], rank
        assert mine == {**saved["in_force"], "controller": mine["controller"]}
        # Same level, limit, shares and error feedback: the same updates, bit for bit.
        assert got["weights"] == saved["weights"], f"rank {rank}: weights differ after resume"
    regime = first[0]["in_force"]["controller"]["regime"]
    assert regime["previous_grad_norm"] is not None  # windows had run: not the defaults

    con = store.open(tmp_path / "runs" / "resume")
    rows = con.execute(
        "SELECT rank, evidence FROM events WHERE name = 'resumed' ORDER BY rank"
    ).fetchall()
    assert [r for r, _ in rows] == [0, 1]
    for rank, evidence in rows:
        actuator = json.loads(evidence)["actuator"]
        assert actuator["restored"] and actuator["compression"]["level"] == "int8"
        assert actuator["micro_batch"]["limit"] == (2 if rank == 0 else 1)
        assert actuator["error_feedback"] == {"parameters": 1}
        assert "regime" in actuator["controller"]["restored"]

    # One rank's state made malformed (and the checkpoint re-sealed, so it is no corrupt file
    # but a bad value): every rank refuses to resume, naming that rank and the key.
    newest = committed_newest_first(tmp_path / "ckpt")[0]
    path = extra_path(newest.path, 1)
    extra = json.loads(path.read_text())
    extra["trainspec"]["actuator"]["micro_batch"]["limit"] = -1
    path.write_text(json.dumps(extra))
    write_commit(newest.path, step=newest.step, world_size=2, reason="test")
    torchrun(tmp_path / "runs", "damaged", script=SCRIPT, env=ENV,
             script_args=[str(tmp_path), ckpt, "damaged"], timeout_s=200)  # fmt: skip
    for report in _reports(tmp_path, "damaged"):
        assert "rank 1: actuator.micro_batch.limit must be a whole number >= 0, got -1" in (
            report.get("error", "")
        ), report
