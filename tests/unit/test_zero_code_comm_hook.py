"""The zero-code layer and a script's own DDP communication hook (DDP takes one)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainspec.runtime.auto import SECOND_HOOK, AutoInstrumentation, _comm_hook_registration
from trainspec.runtime.hook_wiring import HOOKED, hook_of

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Session:
    """Stands for the session: its `attach_hook` registers a hook as trainspec's does."""

    hooks_gradients = True
    grad_source = None

    def __init__(self) -> None:
        self.attached = 0

    def attach_hook(self, model):
        if HOOKED in vars(model):
            return None
        self.attached += 1
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        vars(model)[HOOKED] = "trainspec's"
        return "trainspec's"

    def share_batch(self, n: int) -> None:
        pass


@pytest.fixture
def auto(monkeypatch):
    layer = AutoInstrumentation()
    layer.session = Session()
    for name in ("register_comm_hook", "_register_builtin_comm_hook"):
        original = getattr(DistributedDataParallel, name)
        monkeypatch.setattr(DistributedDataParallel, name, _comm_hook_registration(layer, original))
    return layer


def ddp(auto: AutoInstrumentation) -> DistributedDataParallel:
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    auto.on_ddp_model(model)  # as the patched `DistributedDataParallel.__init__`
    return model


def train(model: DistributedDataParallel) -> None:
    model(torch.randn(2, 4)).sum().backward()


def test_trainspec_s_hook_goes_on_at_the_first_forward_before_the_backward(auto):
    model = ddp(auto)
    assert auto.session.attached == 0
    with torch.no_grad():
        model(torch.randn(2, 4))  # an evaluation first: no hook yet
    assert auto.session.attached == 0
    train(model)
    assert auto.session.attached == 1 and hook_of(model) == "trainspec's"
    assert auto.session.grad_source == "trainspec's"
    train(model)
    assert auto.session.attached == 1


@pytest.mark.parametrize("builtin", [False, True])
def test_a_script_s_own_hook_before_the_first_forward_turns_trainspec_s_off(auto, caplog, builtin):
    """`model.register_comm_hook(dist.group.WORLD, fp16_compress_hook)` right after DDP:
    both ranks raised "can only be called once" (QA, 2026-11-27)."""
    model = ddp(auto)
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        if builtin:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        else:
            model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        for _ in range(2):
            train(model)
    assert auto.session.attached == 0 and auto.session.grad_source is None
    assert HOOKED in vars(model) and hook_of(model) is None  # declined, as for sparse
    warned = [r for r in caplog.records if "registers its own communication hook" in r.message]
    assert len(warned) == 1


def test_a_script_s_own_hook_after_the_first_forward_fails_with_a_clear_message(auto):
    model = ddp(auto)
    train(model)
    with pytest.raises(RuntimeError, match="before the model's first forward") as raised:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert str(raised.value) == SECOND_HOOK


def test_the_script_starting_trainspec_itself_hooks_its_models_at_once(auto):
    """`trainspec.init()` after the model was built: its `actuate` finds the hook."""
    model = ddp(auto)
    auto.stand_down()
    assert auto.session.attached == 1 and hook_of(model) == "trainspec's"
    train(model)
    assert auto.session.attached == 1
