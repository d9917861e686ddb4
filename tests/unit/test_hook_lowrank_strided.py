"""Low-rank compression of a transposed (dense, non-contiguous) parameter, on one rank with a
real DDP model. DDP lays its gradient into the bucket in memory order, the base matrix's;
the codec used to plan it by the logical shape, so its matrix was the bucket's values cut
into rows across the real ones: a rank-1 gradient became a full-rank matrix, and rank-1
PowerSGD kept a fraction of it (the rest waited in error feedback). Planned as the bucket
holds it (`residual_layout.bucket_shapes`), the matrix is the gradient's transpose, rank 1,
and one subspace-iteration step recovers it."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels.hook import CompressionHook

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]


class Transposed(torch.nn.Module):
    """y = x @ W with W held as the transpose of a (16, 24) tensor: shape (24, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 24).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


@pytest.mark.parametrize("as_view", [False, True], ids=["copied", "bucket_view"])
def test_a_rank_one_gradient_of_a_transposed_weight_passes_rank_one_powersgd(
    as_view: bool,
) -> None:
    torch.manual_seed(0)
    model = Transposed()
    assert not model.weight.is_contiguous()
    ddp = DDP(model, gradient_as_bucket_view=as_view)
    hook = CompressionHook("lowrank:1")
    hook.register(ddp)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, c = torch.randn(1, 24, generator=gen), torch.randn(1, 16, generator=gen)
        ddp.zero_grad()
        (ddp(x) * c).sum().backward()
        want = x.t() @ c  # one sample: the gradient is rank 1
        got = model.weight.grad
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-4, f"step {step}: relative error {error:.3g}"
