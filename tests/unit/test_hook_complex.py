"""Complex parameters through CompressionHook, on one rank with a real DDP model. DDP sums a
complex gradient as its real view (two floats a value, `torch.view_as_real`), so a bucket
holds 2 x numel values for such a parameter. Before, the hook counted p.numel(): at lowrank the
codec's plan raised in backward ("parameter shapes cover 128 values, bucket has 256"), and at
int8 and topk `error_feedback()` left the parameter out and DDP's rebuild dropped its
residual (relative error 2e-3 at int8, 0.14 at topk after a flush; QA, 2026-11-27)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels.hook import CompressionHook

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]
STEPS = 4
LEVELS = ["int8", "topk:0.3", "lowrank:1", "lowrank-bf16:2"]


class Complex(torch.nn.Module):
    """Two complex matrices (compressed at lowrank), a complex vector (sent exactly there) and
    a real vector; `first` is used first, so its gradient is ready last and DDP's rebuild
    reorders the complex bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(0.3 * torch.randn(16, 12, dtype=torch.cfloat))
        self.second = torch.nn.Parameter(0.3 * torch.randn(12, 8, dtype=torch.cfloat))
        self.shift = torch.nn.Parameter(torch.randn(8, dtype=torch.cfloat))
        self.scale = torch.nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x * self.scale).to(torch.cfloat) @ self.first
        return (h @ self.second + self.shift).abs().pow(2)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 8, generator=gen)
    return ((model(x) - y) ** 2).mean()


def _real(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as the bucket and `error_feedback` count them, flat."""
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)


def _job(level: str) -> tuple[DDP, CompressionHook, dict[str, torch.nn.Parameter]]:
    torch.manual_seed(0)
    ddp = DDP(Complex(), bucket_cap_mb=1024 / 2**20)
    hook = CompressionHook(level)
    hook.register(ddp)
    return ddp, hook, dict(ddp.module.named_parameters())


@pytest.mark.parametrize("level", LEVELS)
def test_applied_plus_held_residuals_sum_to_the_gradients_of_complex_parameters(
    level: str,
) -> None:
    ddp, hook, named = _job(level)
    applied = {n: torch.zeros_like(_real(p)) for n, p in named.items()}
    for _ in range(STEPS):
        ddp.zero_grad()
        _loss(ddp).backward()
        for n, p in named.items():
            applied[n] += _real(p.grad)
    held = hook.error_feedback()
    assert {pid: t.numel() for pid, t in held.items()} == {
        id(p): 2 * p.numel() if p.is_complex() else p.numel() for p in named.values()
    }
    ddp.zero_grad()
    _loss(ddp.module).backward()  # the true gradient, without the hook
    for n, p in named.items():
        owed = STEPS * _real(p.grad)
        total = applied[n] + held[id(p)]
        assert ((total - owed).abs().max() / owed.abs().max()).item() < 1e-5, (level, n)


@pytest.mark.parametrize("level", ["int8", "lowrank:1"])
def test_restored_pieces_of_complex_parameters_are_sent(level: str) -> None:
    """Pieces in `error_feedback`'s form (the real view's values) restored into a fresh job:
    a lossless step sends each once, whatever the lossy steps before it kept."""
    ddp, hook, named = _job(level)
    torch.manual_seed(3)
    pieces = {n: 1e-2 * torch.randn(_real(p).numel()) for n, p in named.items()}
    hook.restore_error_feedback({id(named[n]): t.clone() for n, t in pieces.items()})
    applied = {n: torch.zeros_like(_real(p)) for n, p in named.items()}
    for step in range(STEPS):
        if step == STEPS - 1:
            hook.set_level("none")  # flushes what is held
        ddp.zero_grad()
        _loss(ddp).backward()
        for n, p in named.items():
            applied[n] += _real(p.grad)
    assert hook.error_feedback() == {}
    ddp.zero_grad()
    _loss(ddp.module).backward()
    for n, p in named.items():
        owed = STEPS * _real(p.grad) + pieces[n]
        assert ((applied[n] - owed).abs().max() / owed.abs().max()).item() < 1e-5, (level, n)
