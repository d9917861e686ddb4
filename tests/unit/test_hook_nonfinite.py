"""A step whose gradient holds a NaN or an infinity must not poison error feedback. Before,
at int8 the NaN came out as finite codes (scale 1) and the residual stayed NaN, so the rank's
gradient was lost from every later step; at lowrank the residual and the warm-started Q
stayed NaN and every later sum was NaN (QA, 2026-11-27). Now the step's sum is not finite
(a GradScaler skips it, as at `none`), and error feedback and warm starts are as before it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels.codecs.int8 import dequantize_accumulate, quantize_with_feedback
from trainspec.kernels.hook import CompressionHook

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]
LEVELS = ["int8", "lowrank:2", "lowrank-bf16:2:1:exact", "topk:0.1"]


def _grads(ddp: DDP) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])


def _backward(ddp: DDP, step: int, bad: float | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    if bad is not None:
        x[0, 0] = bad
    ddp.zero_grad(set_to_none=False)
    ((ddp(x) - y) ** 2).mean().backward()
    return _grads(ddp)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("level", LEVELS)
def test_a_nonfinite_step_leaves_error_feedback_as_it_was(level: str, bad: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    clean = DDP(model)
    clean_hook = CompressionHook(level)
    clean_hook.register(clean)
    torch.manual_seed(0)
    hit = DDP(torch.nn.Sequential(*(type(m)(*_args(m)) for m in model)))
    hit.module.load_state_dict(model.state_dict())
    hook = CompressionHook(level)
    hook.register(hit)
    # Parameters stay fixed: the clean job skips the bad step, the other takes it.
    for step in range(2):
        _backward(clean, step)
        _backward(hit, step)
    assert not torch.isfinite(_backward(hit, 2, bad)).all()  # seen, as at `none`
    clean_hook._codec.forget_warm_starts()  # lowrank's Q starts again from the seed there
    for step in range(3, 6):
        want, got = _backward(clean, step), _backward(hit, step)
        assert torch.isfinite(got).all(), f"step {step} at {level}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    residuals = hook.error_feedback()
    assert residuals and all(torch.isfinite(t).all() for t in residuals.values())


def _args(module: torch.nn.Module) -> tuple:
    if isinstance(module, torch.nn.Linear):
        return (module.in_features, module.out_features)
    return ()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_an_int8_block_holding_a_nonfinite_value_decodes_nonfinite(bad: float) -> None:
    grad = torch.linspace(-1, 1, 512)
    grad[300] = bad
    codes, scales, _ = quantize_with_feedback(grad, 1.0, None, 256)
    out = torch.zeros(512)
    dequantize_accumulate(out, codes, scales, 256)
    assert torch.isfinite(out[:256]).all()  # the other block is as before
    assert not torch.isfinite(out[256:]).all()
    zeros_codes, zero_scales, _ = quantize_with_feedback(torch.zeros(512), 1.0, None, 256)
    assert (zero_scales == 1).all() and (zeros_codes == 0).all()  # an all-zero block: scale 1
