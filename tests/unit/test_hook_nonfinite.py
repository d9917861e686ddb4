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


class Given(torch.nn.Module):
    """A gradient chosen by the caller: d/dw (w . g) = g (an 8 x 8 matrix: lowrank
    compresses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8, 8))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g.view(8, 8)).sum()


def _given(step: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(64, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("level", ["int8", "topk:0.25", "lowrank:1"])
def test_a_finite_step_whose_squared_norm_passes_float32_keeps_its_error_feedback(
    level: str,
) -> None:
    """Values about 1e20 are finite, but their squares are not in float32. Before, the step
    was taken for a non-finite one: its error feedback went back to where it stood before
    it, although its finite sum was applied, so the residual it had consumed was owed twice
    (relative error 6e-3 at int8, 0.5 at topk after a flush; QA, 2026-11-27)."""
    ddp = DDP(Given())
    hook = CompressionHook(level)
    hook.register(ddp)
    applied, owed = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for step in range(4):
        g = _given(step, 1e20 if step == 1 else 1.0)
        ddp.zero_grad()
        ddp(g).backward()
        applied += ddp.module.w.grad.reshape(-1).double()
        owed += g.double()
        stats = hook.latest_stats()
        assert stats is not None and math.isfinite(stats.grad_norm), step
    hook.set_level("none")  # flushes what is held
    ddp.zero_grad()
    ddp(torch.zeros(64)).backward()
    applied += ddp.module.w.grad.reshape(-1).double()
    assert hook.error_feedback() == {}
    assert ((applied - owed).abs().max() / owed.abs().max()).item() < 1e-6


def _int8_with_a_residual() -> tuple[DDP, CompressionHook, torch.Tensor]:
    """A DDP model at int8 after two steps, and the residual it holds."""
    ddp = DDP(Given())
    hook = CompressionHook("int8")
    hook.register(ddp)
    for step in range(2):
        ddp.zero_grad()
        ddp(_given(step)).backward()
    return ddp, hook, hook.error_feedback()[id(ddp.module.w)]


def test_a_lossless_step_past_float32_flushes_error_feedback_once() -> None:
    """At `none` the statistics ride in the bucket's float32 all-reduce, where a finite
    |g|^2 above 3.4e38 reads back as infinite: the step that flushes error feedback must still
    count as finite, or what it flushed is owed again and flushed twice."""
    ddp, hook, held = _int8_with_a_residual()
    assert held.abs().max() > 0
    hook.set_level("none")
    g = _given(2, 1e20)
    ddp.zero_grad()
    ddp(g).backward()
    torch.testing.assert_close(ddp.module.w.grad.reshape(-1), g + held)
    assert hook.error_feedback() == {}
    ddp.zero_grad()
    ddp(_given(3)).backward()
    torch.testing.assert_close(ddp.module.w.grad.reshape(-1), _given(3))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_lossless_step_owes_back_what_it_flushed(bad: float) -> None:
    """The other side of the test above: at `none` (statistics carried in float32) a NaN or
    an infinity still makes the step non-finite, and the residual it consumed is owed again."""
    ddp, hook, held = _int8_with_a_residual()
    hook.set_level("none")
    g = _given(2)
    g[5] = bad
    ddp.zero_grad()
    ddp(g).backward()
    assert not torch.isfinite(ddp.module.w.grad).all()
    torch.testing.assert_close(hook.error_feedback()[id(ddp.module.w)], held)


@pytest.mark.parametrize("level", LEVELS)
def test_a_float64_step_past_float32_range_leaves_error_feedback_as_it_was(level: str) -> None:
    """A float64 model's finite gradient past 3.4e38: the lossy codecs encode in float32,
    where it is an infinity. Before, the hook judged the step by its float64 norm (finite),
    kept the NaN (int8, lowrank) or infinite (topk) residuals, and every later step's sum
    was not finite (QA 2026-11-28). Now it is a non-finite step, rolled back as one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = model.double()
    ddp = DDP(model)
    hook = CompressionHook(level)
    hook.register(ddp)

    def backward(step: int, scale: float = 1.0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        ddp.zero_grad(set_to_none=False)
        (((ddp(x.double()) - y.double()) ** 2).mean() * scale).backward()
        return _grads(ddp)

    for step in range(2):
        backward(step)
    before = {k: v.clone() for k, v in hook.error_feedback().items()}
    backward(2, scale=1e40)  # float64: finite; in float32: infinite
    after = hook.error_feedback()
    assert after.keys() == before.keys()
    for key, t in after.items():
        assert torch.equal(t, before[key]), f"{level}: error feedback changed by the step"
    for step in range(3, 6):
        assert torch.isfinite(backward(step)).all(), f"step {step} at {level}"


@pytest.mark.parametrize("weight", [1.0, 0.5, 0.01, 2.0])
def test_a_float64_value_past_float32_range_is_caught_whatever_the_weight(weight: float) -> None:
    """`weighted` converts to float32 before it weighs: 5e38 is an infinity there whatever
    the weight. With the weight applied first, a rank of two (0.5) let it through (review)."""
    from trainspec.kernels.codecs.base import weighted
    from trainspec.kernels.hook import _past_float32

    g = torch.tensor([5e38, 1.0], dtype=torch.float64)
    assert not torch.isfinite(weighted(g, weight, None)).all()
    assert math.isinf(_past_float32(g, weight, torch.tensor(1.0, dtype=torch.float64)).item())
    fine = torch.tensor([3e38, 1.0], dtype=torch.float64)
    expect_inf = 3e38 * weight > 3.4028234663852886e38
    got = _past_float32(fine, weight, torch.tensor(1.0, dtype=torch.float64)).item()
    assert math.isinf(got) == expect_inf == (not torch.isfinite(weighted(fine, weight, None)).all())
