"""Resuming a job that does not fit its checkpoints: one line saying why, nothing touched.

A checkpoint of another model failed with dcp's whole remote traceback, cut at 500
characters before its cause, once per checkpoint (117 lines, no "size mismatch"); one of
another global batch, seed or dataset raised a raw SamplerStateError after model and
optimizer were already overwritten (QA sweep of the actuator).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.unit.test_checkpoint import _Job, _params, _three_checkpoints
from trainspec.data import ShareBatchSampler
from trainspec.runtime.checkpoint import CheckpointError, SamplerMismatchError
from trainspec.runtime.checkpoint_layout import committed_newest_first

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def test_a_checkpoint_of_another_model_fails_in_one_line_naming_the_size_mismatch(
    tmp_path: Path, caplog
) -> None:
    events: list = []
    ck, _ = _three_checkpoints(tmp_path, events)
    other = _Job(seed=1)
    other.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                      torch.nn.Linear(32, 4))  # fmt: skip
    other.opt = torch.optim.AdamW(other.model.parameters(), lr=1e-2)
    other.sched = torch.optim.lr_scheduler.StepLR(other.opt, step_size=2, gamma=0.5)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as err:
        other.load(ck)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert "Size mismatch" in message and "0.weight" in message, message
    assert message.count("Size mismatch") == 1, message  # one cause for the three of them
    assert all(c.path.name in message for c in committed_newest_first(tmp_path))
    fallbacks = [e[2]["error"] for e in events if e[1] == "fallback"]
    assert len(fallbacks) == 3 and all("\n" not in f and "Size mismatch" in f for f in fallbacks)
    warned = [r.getMessage() for r in caplog.records if "older checkpoint" in r.getMessage()]
    assert len(warned) == 3 and all("\n" not in w for w in warned)
    assert [c.step for c in committed_newest_first(tmp_path)] == [3, 2, 1]  # none set aside
    ck.close()


@pytest.mark.parametrize(
    ("sampler", "names"),
    [
        (ShareBatchSampler(40, 4, rank=0, world_size=1, seed=0), "global_batch=8"),
        (ShareBatchSampler(40, 8, rank=0, world_size=1, seed=3), "seed=0"),
        (ShareBatchSampler(48, 8, rank=0, world_size=1, seed=0), "dataset_len=40"),
    ],
)
def test_a_checkpoint_of_another_batch_seed_or_dataset_is_refused_before_loading(
    tmp_path: Path, sampler: ShareBatchSampler, names: str
) -> None:
    ck, _ = _three_checkpoints(tmp_path, [])
    job = _Job(seed=1)
    job.sampler = sampler
    before = _params(job.model)
    with pytest.raises(SamplerMismatchError) as err:
        job.load(ck)
    message = str(err.value)
    assert "\n" not in message and names in message and "another data setup" in message
    assert all(torch.equal(a, b) for a, b in zip(before, _params(job.model), strict=True))
    assert job.opt.state == {}  # nothing loaded into the optimizer either
    assert sampler.position == 0 and sampler.epoch == 0
    assert [c.step for c in committed_newest_first(tmp_path)] == [3, 2, 1]
    ck.close()
