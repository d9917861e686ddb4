"""A rank's own tensors (error feedback) in the Checkpointer's save: a file of the rank's own,
snapshot when `save` returns, covered by the commit manifest like every shard, so a damaged
one makes the load fall back rather than resume with garbage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainspec.runtime import rank_tensors
from trainspec.runtime.checkpoint import Checkpointer
from trainspec.runtime.checkpoint_layout import (
    COMMIT_NAME,
    committed_newest_first,
    rank_tensors_path,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("async_save", [True, False])
def test_rank_tensors_are_saved_as_of_the_call_and_committed(
    tmp_path: Path, async_save: bool
) -> None:
    model, opt = _model_and_optimizer()
    ck = Checkpointer(tmp_path, async_save=async_save, timeout_s=30)
    residual = torch.arange(6, dtype=torch.float32)
    ck.save(1, model=model, optimizer=opt, rank_tensors={"module.weight": residual})
    residual.fill_(-1.0)  # the loop moves on at once: the save holds the values of the call
    ck.wait()
    (newest,) = committed_newest_first(tmp_path)
    manifest = json.loads((newest.path / COMMIT_NAME).read_text())
    assert "extra/rank0.tensors.pt" in manifest["files"]
    saved = rank_tensors.read(newest.path, 0)
    assert list(saved) == ["module.weight"]
    assert torch.equal(saved["module.weight"], torch.arange(6, dtype=torch.float32))
    ck.close()


def test_no_rank_tensors_no_file(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    ck = Checkpointer(tmp_path, async_save=False, timeout_s=30)
    ck.save(1, model=model, optimizer=opt, rank_tensors={})
    (newest,) = committed_newest_first(tmp_path)
    assert rank_tensors.read(newest.path, 0) == {}
    assert not rank_tensors_path(newest.path, 0).exists()
    ck.close()


def test_a_damaged_tensor_file_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    events: list[tuple[str, dict]] = []
    ck = Checkpointer(tmp_path, async_save=False, timeout_s=30,
                      on_event=lambda kind, reason, ev: events.append((reason, ev)))  # fmt: skip
    for step in (1, 2):
        ck.save(step, model=model, optimizer=opt, rank_tensors={"w": torch.full((3,), step)})
    newest = committed_newest_first(tmp_path)[0]
    rank_tensors_path(newest.path, 0).write_bytes(b"damaged")
    loaded = ck.load_latest(model=model, optimizer=opt)
    assert loaded is not None and loaded.step == 1
    assert [r for r, _ in events if r == "fallback"] == ["fallback"]
    assert "rank0.tensors.pt" in next(ev["error"] for r, ev in events if r == "fallback")
    ck.close()
