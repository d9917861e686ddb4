"""`trainspec validate` on a rank that stored fewer steps than the others: lost rows, or an
end the rank recorded itself (its step failed, or its data ran out under DDP's join)."""

from __future__ import annotations

import pytest

from tests.helpers.runs import synthetic_run, write_run
from trainspec.store.compliance import validate_target

LOST = "which other ranks stored (the last rows of a process that was killed"


def _event(run, rank: int, step: int, kind: str, name: str) -> dict:
    return {**run.events[0], "rank": rank, "step": step, "kind": kind, "name": name}


def _short_run(tmp_path, name: str, end: list[tuple[int, str, str]], cut: int = 4):
    """Two ranks; rank 1's last `cut` steps have no row; `end`: rank 1's events
    (offset from its last stored step, kind, name)."""
    run = synthetic_run(2, 2.0, False)
    last = max(r["step"] for r in run.steps)
    run.steps = [r for r in run.steps if not (r["rank"] == 1 and r["step"] > last - cut)]
    kept = last - cut
    run.events += [_event(run, 1, kept + offset, kind, n) for offset, kind, n in end]
    return validate_target(str(write_run(tmp_path / name, run))).warnings


@pytest.mark.parametrize(
    "end",
    [
        [(1, "anomaly", "uneven_inputs")],  # its data ran out: it shadowed the others' steps
        [(1, "fault", "step_failed")],  # it raised in the step after its last stored one
    ],
)
def test_a_rank_whose_end_is_on_record_ran_fewer_steps_and_lost_none(tmp_path, end):
    """A `ddp.join()` run's short rank read as killed with its last rows (QA 2026-11-27),
    as did a rank that raised after its backward, its peer finishing the step it had
    failed in and failing in the next."""
    assert _short_run(tmp_path, "ended", end) == []


@pytest.mark.parametrize(
    "end",
    [
        [],
        [(-2, "anomaly", "uneven_inputs")],  # it joined, trained again, and was killed
        [(-2, "fault", "step_failed")],  # a failure it caught, then killed
        [(1, "anomaly", "nonfinite_loss")],  # another event says nothing of its end
    ],
)
def test_a_rank_whose_end_is_not_on_record_is_warned(tmp_path, end):
    warnings = _short_run(tmp_path, "killed", end)
    assert (
        len(warnings) == 1
        and warnings[0].startswith("rank 1: no row for steps")
        and (LOST in warnings[0])
    ), warnings


def test_a_step_that_failed_on_one_rank_is_not_one_the_others_lost(tmp_path):
    """Rank 1 raised after its last step (an evaluation): its step_failed is one step past
    every stored row, and no other rank lost a row there."""
    run = synthetic_run(2, 2.0, False)
    last = max(r["step"] for r in run.steps)
    run.events.append(_event(run, 1, last + 1, "fault", "step_failed"))
    assert validate_target(str(write_run(tmp_path / "run", run))).warnings == []
