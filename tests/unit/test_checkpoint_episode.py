"""The loss-spike episode through a checkpoint (runtime/checkpoint_episode.py): a job restarted
in the middle of one goes on with it. Before, it measured its loss reference afresh at the
high loss, saw no spike, marked its saves as taken in no anomaly, and retention (`keep_last`)
deleted the last checkpoint from before the trouble."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_actuator_detectors import window
from tests.unit.test_actuator_state import Job
from tests.unit.test_checkpoint import _Job
from trainspec.actuator import Controller, Targets
from trainspec.actuator.findings import Action, Finding
from trainspec.config import ActuatorConfig
from trainspec.runtime.checkpoint import Checkpointer
from trainspec.runtime.checkpoint_episode import episode_state, load_episode_state
from trainspec.runtime.checkpoint_layout import CheckpointError, committed_newest_first, marks

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]
NORMAL, HIGH = 1.0, 4.0  # window mean losses before and during the spike (factor 1.5)


def controller(**targets: Any) -> Controller:
    """A rank-0 controller with a checkpoint policy (a save callback; a cost never measured)."""
    return Controller(
        ActuatorConfig(), world_size=2, group=None, emit=lambda *a, **k: None,
        targets=Targets(rank=0, global_batch=16, checkpoint=lambda step, reason: None, **targets),
        checkpoint_interval=lambda cost_s, step_s: 10**6,
    )  # fmt: skip


def decide(ctl: Controller, step: int, loss: float, *extra: Finding) -> Action | None:
    """One window of two ranks at mean loss `loss`: what the loss detector finds, and what the
    checkpoint policy decides on it (the controller's own order)."""
    summaries = window([0.01, 0.01], loss_mean=loss)
    findings = [*ctl.loss.observe(summaries), *extra]
    assert ctl.checkpointing is not None
    return ctl.checkpointing.decide(summaries, step, findings)


def in_a_spike() -> Controller:
    """Two windows at the normal loss (the first checkpoints, to measure its cost), then the
    spike at step 15, checkpointed at once."""
    ctl = controller()
    assert decide(ctl, 5, NORMAL) is not None
    assert decide(ctl, 10, NORMAL) is None
    spike = decide(ctl, 15, HIGH)
    assert spike is not None and spike.reason == "checkpoint now: loss spike"
    return ctl


def saved(ctl: Controller) -> dict[str, Any]:
    """The episode as a checkpoint's JSON gives it back."""
    return json.loads(json.dumps(episode_state(ctl)))


def test_a_restored_episode_goes_on_and_a_fresh_one_saw_no_spike() -> None:
    state = saved(in_a_spike())
    assert state == {
        "loss": {"reference": NORMAL},
        "checkpoint": {"loss_trouble": {"loss_spike": 15}},
    }

    resumed = controller()
    evidence = load_episode_state(resumed, state)
    assert evidence == {"restored": ["loss", "checkpoint"], "loss_reference": NORMAL,
                        "anomaly": "loss spike since step 15"}  # fmt: skip
    first = decide(resumed, 20, HIGH)  # still a spike, against the reference from before it
    assert first is not None and first.reason == "first checkpoint, to measure its cost"
    assert resumed.checkpointing is not None
    assert resumed.checkpointing.anomaly == "loss spike since step 15"  # no new episode

    afresh = controller()  # what a restart did: the high loss became the reference
    assert decide(afresh, 20, HIGH) is not None
    assert afresh.checkpointing is not None and afresh.checkpointing.anomaly is None
    assert afresh.loss.reference == HIGH


def test_keep_last_1_keeps_the_checkpoint_from_before_the_spike_across_a_restart(
    tmp_path: Path,
) -> None:
    """Saves marked as the checkpoint policy marks them, restarted from the one taken in the
    spike: the restarted job's first save is still marked, so retention keeps step 5."""
    ck = Checkpointer(tmp_path, keep_last=1, async_save=False)
    job, ctl = _Job(), controller()
    for step, loss in ((5, NORMAL), (10, NORMAL), (15, HIGH)):
        job.step()
        if decide(ctl, step, loss) is not None:
            assert ctl.checkpointing is not None
            ck.save(step, model=job.model, optimizer=job.opt, trainspec_state=saved(ctl),
                    anomaly=ctl.checkpointing.anomaly)  # fmt: skip
    assert [c.step for c in committed_newest_first(tmp_path)] == [15, 5]
    ck.close()

    ck = Checkpointer(tmp_path, keep_last=1, async_save=False)  # the restarted job
    job, resumed = _Job(seed=1), controller()
    loaded = ck.load_latest(model=job.model, optimizer=job.opt)
    assert loaded is not None and loaded.step == 15
    load_episode_state(resumed, loaded.trainspec_state)
    job.step()
    assert decide(resumed, 20, HIGH) is not None and resumed.checkpointing is not None
    ck.save(20, model=job.model, optimizer=job.opt, anomaly=resumed.checkpointing.anomaly)
    kept = committed_newest_first(tmp_path)
    assert [(c.step, marks(c)) for c in kept] == [
        (20, (True, "loss spike since step 15")),
        (5, (True, None)),
    ]
    ck.close()


def test_a_new_preemption_after_the_restore_still_checkpoints_at_once() -> None:
    """Only the loss anomaly is carried over: a trouble of another kind in the restarted job
    is a new episode."""
    resumed = controller()
    load_episode_state(resumed, saved(in_a_spike()))
    action = decide(resumed, 20, HIGH, Finding("preemption", "SIGTERM"))
    assert action is not None and action.reason == "checkpoint now: preemption signal"


def with_controller(job: Job) -> Job:
    job.state.controller = controller(hook=job.hook, micro_batch=job.plan)
    return job


def test_the_actuator_state_saves_and_restores_the_episode(tmp_path: Path) -> None:
    first = with_controller(Job("none"))
    assert first.state.controller is not None
    spiking = in_a_spike()
    first.state.controller.loss = spiking.loss
    first.state.controller.checkpointing = spiking.checkpointing
    state, _ = first.state.snapshot()
    state = json.loads(json.dumps(state))
    assert state["actuator"]["episode"] == saved(spiking)

    resumed = with_controller(Job("none"))
    evidence = resumed.state.restore(state, tmp_path)
    assert evidence["episode"]["anomaly"] == "loss spike since step 15"
    ctl = resumed.state.controller
    assert ctl is not None and ctl.loss.reference == NORMAL


def test_a_checkpoint_without_the_episode_starts_afresh(tmp_path: Path) -> None:
    job = with_controller(Job("none"))
    evidence = job.state.restore({"actuator": {"micro_batch": {"limit": 2}}}, tmp_path)
    assert evidence["episode"]["restored"] == [] and "not saved" in evidence["episode"]["why"]
    ctl = job.state.controller
    assert ctl is not None and ctl.checkpointing is not None
    assert math.isnan(ctl.loss.reference) and ctl.checkpointing.anomaly is None


@pytest.mark.parametrize(
    ("episode", "words"),
    [
        ([], "actuator.episode must be an object"),
        ({"loss": {"reference": "high"}}, "actuator.episode.loss: reference must be a number"),
        (
            {"loss": {"reference": 1.0}, "checkpoint": {"loss_trouble": {"loss_spike": -1}}},
            "actuator.episode.checkpoint: loss_trouble.loss_spike must be a whole number >= 0",
        ),
        ({"checkpoint": {"loss_trouble": {"fire": 3}}}, "'fire' is not one of"),
        ({"checkpoint": {"loss_trouble": [15]}}, "loss_trouble must be an object"),
    ],
)
def test_a_malformed_episode_is_named_and_nothing_is_restored(
    tmp_path: Path, episode: Any, words: str
) -> None:
    job = with_controller(Job("none"))
    state = {"actuator": {"micro_batch": {"limit": 2}, "episode": episode}}
    with pytest.raises(CheckpointError, match=words):
        job.state.restore(state, tmp_path)
    ctl = job.state.controller
    assert ctl is not None and ctl.checkpointing is not None
    assert math.isnan(ctl.loss.reference) and ctl.checkpointing.anomaly is None
    assert job.plan.limit == 8
