"""StateStager: the cached snapshot equals get_state_dict's, and is rebuilt when it would not."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainspec.runtime.checkpoint import Checkpointer
from trainspec.runtime.checkpoint_layout import committed_newest_first, remove
from trainspec.runtime.checkpoint_staging import StateStager

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


class _Job:
    def __init__(self, seed: int = 0, model: torch.nn.Module | None = None) -> None:
        torch.manual_seed(seed)
        self.model = model or torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)

    def step(self) -> None:
        loss = self.model(torch.randn(5, 8)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()  # changes param_groups' lr: a non-tensor value that must be fresh

    def expected(self) -> dict[str, Any]:
        """What a synchronous save would write now, copied."""
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return _clone({"model": model_sd, "optim": optim_sd})


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_staged_state_is_get_state_dicts_and_a_copy() -> None:
    job, stager = _Job(), StateStager(pin_memory=False)
    for _ in range(3):
        job.step()
        want = job.expected()
        staged = stager.stage(job.model, job.opt)
        _assert_same(staged, want)
        job.step()  # training goes on at once: the staged copy must not move
        _assert_same(staged, want)
    assert stager.rebuilds == 1  # one get_state_dict for all three saves


def test_mapping_is_rebuilt_when_the_optimizer_gets_new_state_tensors() -> None:
    job, stager = _Job(), StateStager(pin_memory=False)
    job.step()
    stager.stage(job.model, job.opt)
    job.opt.load_state_dict(copy.deepcopy(job.opt.state_dict()))  # as loading does: new tensors
    job.step()
    want = job.expected()
    _assert_same(stager.stage(job.model, job.opt), want)  # stale tensors would differ here
    assert stager.rebuilds == 2


def test_mapping_is_rebuilt_when_a_parameter_is_replaced() -> None:
    job, stager = _Job(), StateStager(pin_memory=False)
    job.step()
    stager.stage(job.model, job.opt)
    with torch.no_grad():
        job.model[0].bias.data = job.model[0].bias.data + 1.0  # new storage, same parameter
    want = job.expected()
    _assert_same(stager.stage(job.model, job.opt), want)
    assert stager.rebuilds == 2


class _WithExtraState(torch.nn.Module):
    """A module whose state dict holds a non-tensor value: the cache does not cover it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]


def test_state_the_cache_does_not_cover_is_staged_the_general_way() -> None:
    job, stager = _Job(model=_WithExtraState()), StateStager(pin_memory=False)
    for _ in range(2):
        job.step()
        want = job.expected()
        staged = stager.stage(job.model, job.opt)
        job.step()
        _assert_same(staged, want)
    stager.close()


def test_back_to_back_async_saves_each_keep_their_own_snapshot(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, async_save=True, keep_last=3)
    job = _Job()
    snapshots = {}
    for step in (1, 2, 3):
        job.step()
        snapshots[step] = [p.detach().clone() for p in job.model.parameters()]
        ck.save(step, model=job.model, optimizer=job.opt)  # reuses the buffers of the last one
        with torch.no_grad():
            for p in job.model.parameters():
                p.mul_(-3.0)  # the loop overwrites parameters while the save is in flight
    ck.wait()
    for step in (3, 2, 1):
        newest = committed_newest_first(tmp_path)[0]
        assert newest.step == step
        fresh = _Job(seed=7)
        assert ck.load_latest(model=fresh.model, optimizer=fresh.opt).step == step
        for got, want in zip(fresh.model.parameters(), snapshots[step], strict=True):
            assert torch.equal(got.detach(), want), f"checkpoint {step} holds another step's state"
        remove(newest)
    ck.close()
