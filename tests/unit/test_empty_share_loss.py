"""An empty share has no loss: the placeholder's 0.0 must not reach the controller's means.

A rank with no samples in a step (an epoch's remainder split [1, 0], or a share rebalanced
to 0 with `actuator.min_share = 0`) runs one placeholder sample at weight 0; the example
reported that step's loss as 0.0, which was stored and averaged, unweighted, into the window
means the loss detector and the compression policy read (QA sweep of the actuator).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch

from trainspec.actuator import Controller, Targets
from trainspec.actuator.summary import WindowAccumulator
from trainspec.collector.records import StepRecord
from trainspec.config import ActuatorConfig
from trainspec.data import ShareBatchSampler, StepBatch
from trainspec.runtime.actuation import Actuation
from trainspec.runtime.inject import FaultPlan, Injector


def _rec(step: int, samples: int, loss: float) -> StepRecord:
    return StepRecord(ts=0, rank=1, step=step, duration_s=0.1, samples=samples, loss=loss)


def _take(acc: WindowAccumulator):
    return acc.take(plan_version=0, share=4, memory=(0.0, 0.0), ckpt_cost_s=math.nan)


def test_a_step_marked_without_loss_stays_out_of_the_window_means() -> None:
    acc = WindowAccumulator(rank=1)
    acc.mark_no_loss(1)
    acc.add(_rec(0, 4, 2.0))
    acc.add(_rec(1, 0, 0.0))  # the placeholder's loss
    acc.add(_rec(2, 4, 4.0))
    s = _take(acc)
    assert (s.steps, s.samples, s.loss_mean, s.loss_last) == (3, 8, 3.0, 4.0)
    acc.mark_no_loss(3)
    acc.add(_rec(3, 0, math.nan))  # nor is a placeholder's NaN a non-finite loss
    s = _take(acc)
    assert s.steps == 1 and math.isnan(s.loss_mean) and s.flags == 0
    acc.add(_rec(4, 0, 5.0))  # a mark is spent once its step has passed
    assert _take(acc).loss_mean == 5.0


def test_accumulate_over_an_empty_share_marks_the_sessions_step_for_the_controller() -> None:
    controller = Controller(ActuatorConfig(), world_size=2, group=None,
                            targets=Targets(rank=1, global_batch=2),
                            emit=lambda *a, **k: None)  # fmt: skip
    session = SimpleNamespace(step_index=7)
    act = Actuation(ShareBatchSampler(10, 2, rank=1, world_size=2),
                    Injector(FaultPlan([]), rank=1), controller, 1, session=session)  # fmt: skip
    model = torch.nn.Linear(2, 1)

    def forward(mb):
        return model(torch.ones(mb.stop - mb.start or 1, 2)).pow(2).mean()

    timer = SimpleNamespace(phase=lambda name: contextlib.nullcontext())  # the ts.step() context
    for step, indices in ((7, []), (8, [3])):
        session.step_index = step
        batch = StepBatch(0, step, indices, 1, (1, 0) if not indices else (0, 1))
        act.accumulate(step, batch, forward, model=model, timer=timer)
        controller.on_record(_rec(step, len(indices), 0.0 if not indices else 1.5))
    s = _take(controller._acc)
    assert (s.steps, s.loss_mean) == (2, 1.5)
