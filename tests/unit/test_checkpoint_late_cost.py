"""A save whose cost comes a window late is waited for, not retried as if it had failed.

QA saw one extra checkpoint in about eight runs: the first save took longer than two
windows, its rank reported no cost at the window that would have carried it, and the policy
took the backoff retry it keeps for a failed save (a full or read-only disk)."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from tests.unit.test_actuator_detectors import window
from trainspec.actuator.actions import Targets
from trainspec.actuator.checkpointing import PENDING, CheckpointPolicy
from trainspec.runtime import checkpoint_layout as layout
from trainspec.runtime.actuation import _checkpoint_cost
from trainspec.runtime.checkpoint import Checkpointer


def _policy() -> CheckpointPolicy:
    return CheckpointPolicy(lambda cost, step_s: int(cost / step_s) * 10)


def test_a_save_still_in_flight_is_waited_for_not_taken_again():
    pol = _policy()
    none = window([0.01, 0.01])
    assert pol.decide(none, 6, []) is not None  # the first, to measure its cost
    late = window([0.01, 0.01], checkpoint_cost_s=[PENDING, PENDING])
    # Two windows on, the retry of a failed save would be due: this one is in flight.
    assert [pol.decide(late, step, []) for step in (11, 16, 21)] == [None, None, None]
    one_late = window([0.01, 0.01], checkpoint_cost_s=[PENDING, math.nan])
    assert pol.decide(one_late, 26, []) is None  # one rank still saving: still in flight
    measured = window([0.01, 0.01], checkpoint_cost_s=[0.5, 0.5], duration_s=0.5)  # 0.1 s/step
    assert pol.decide(measured, 31, []) is None and pol.interval == 50
    action = pol.decide(measured, 56, [])
    assert action is not None and "Young/Daly" in action.reason
    assert action.before == {"last_checkpoint_step": 6}  # no retry in between


def test_a_save_that_failed_after_being_in_flight_is_still_retried():
    pol = _policy()
    assert pol.decide(window([0.01, 0.01]), 6, []) is not None
    late = window([0.01, 0.01], checkpoint_cost_s=PENDING)
    assert pol.decide(late, 11, []) is None and pol.decide(late, 16, []) is None
    failed = window([0.01, 0.01])  # NaN: the save failed, no cost will come
    retry = pol.decide(failed, 21, [])
    assert retry is not None and retry.evidence == {"retry": 1, "after_steps": 15}


class _Job:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank_group")
def test_the_cost_read_for_a_window_says_pending_while_the_first_save_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """What each rank puts in its summary: PENDING while its save has not committed, then
    the save's duration; NaN (no cost, retry) when it failed."""
    release = threading.Event()
    commit = layout.write_commit

    def slow_commit(*args, **kwargs):
        assert release.wait(30)
        return commit(*args, **kwargs)

    monkeypatch.setattr(layout, "write_commit", slow_commit)
    ck = Checkpointer(tmp_path, async_save=True)
    job = _Job()

    def save(step: int, reason: str) -> None:
        ck.save(step, model=job.model, optimizer=job.opt, reason=reason)

    save.checkpointer = ck  # type: ignore[attr-defined]  # as actuation's callback carries it
    source = _checkpoint_cost(save)
    assert source is not None
    targets = Targets(rank=0, global_batch=8, checkpoint=save, checkpoint_cost_source=source)
    assert math.isnan(targets.latest_checkpoint_cost())  # nothing saved yet
    save(6, "first")
    assert targets.latest_checkpoint_cost() == PENDING
    release.set()
    record = ck.wait()
    assert record is not None and targets.latest_checkpoint_cost() == record.duration_s
    ck.close()

    failing = Checkpointer(tmp_path / "failing", async_save=True)
    monkeypatch.setattr(layout, "write_commit", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    save.checkpointer = failing  # type: ignore[attr-defined]
    failing.save(1, model=job.model, optimizer=job.opt)
    assert failing.wait() is None
    source = _checkpoint_cost(save)
    assert source is not None and math.isnan(source())  # failed: not pending
    failing.close()
