"""Gradient noise statistics (McCandlish et al. 2018, app. A) on gradients of known noise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainspec.kernels import GradientStats, MicroStepStats
from trainspec.kernels.stats import NoiseEstimate, NoiseScaleEMA, estimate_noise, squared_norm

DIM, SIGMA = 50, 1.0
TRUE_G = torch.full((DIM,), 0.5)  # |G|^2 = 12.5, tr(Sigma) = 50, B_simple = 4


def test_estimate_noise_inverts_the_expected_norms() -> None:
    g2, trace = 12.5, 50.0
    small, big = g2 + trace / 8, g2 + trace / 32
    est = estimate_noise(small, big, 1 / 8, 1 / 32)
    assert est is not None
    assert est.true_grad_sq == pytest.approx(g2) and est.trace_cov == pytest.approx(trace)


def test_estimate_noise_needs_two_distinct_batch_sizes() -> None:
    assert estimate_noise(1.0, 1.0, 0.5, 0.5) is None
    assert estimate_noise(float("nan"), 1.0, 1.0, 0.5) is None


def test_ema_smooths_numerator_and_denominator_separately() -> None:
    ema = NoiseScaleEMA(decay=0.5)
    assert ema.value() is None
    ema.update(NoiseEstimate(true_grad_sq=1.0, trace_cov=10.0))
    assert ema.value() == pytest.approx(10.0)
    ema.update(NoiseEstimate(true_grad_sq=3.0, trace_cov=10.0))
    assert ema.value() == pytest.approx(10.0 / 2.0)  # not the mean of 10 and 3.33
    ema.update(NoiseEstimate(true_grad_sq=-100.0, trace_cov=1.0))
    assert ema.value() is None  # a non-positive |G|^2 estimate has no ratio
    with pytest.raises(ValueError, match="decay"):
        NoiseScaleEMA(decay=1.0)


def _micro_step(w: torch.nn.Parameter, gen: torch.Generator, batch: int, scale: float) -> None:
    per_sample = TRUE_G + SIGMA * torch.randn(batch, DIM, generator=gen)
    loss = (per_sample @ w).mean() * scale  # d loss / d w = mean of the per-sample gradients
    loss.backward()


@pytest.mark.parametrize("divided", [True, False])
def test_micro_step_stats_recover_the_known_noise_scale(divided: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(DIM))
    stats = MicroStepStats(micro_batch_size=4, loss_divided_by_steps=divided, ema_decay=0.95)
    k = 8
    traces, last = [], None
    for _ in range(300):
        w.grad = None
        for _ in range(k):
            _micro_step(w, gen, 4, 1 / k if divided else 1.0)
            stats.observe([w])
        last = stats.finish_step()
        traces.append(last.grad_variance)
    assert last is not None and last.global_batch == 32 and last.world_size == 1
    mean_trace = sum(traces) / len(traces)
    assert mean_trace == pytest.approx(DIM * SIGMA**2, rel=0.05)
    assert last.grad_noise_scale == pytest.approx(DIM * SIGMA**2 / 12.5, rel=0.25)
    assert last.step == 299


def test_micro_step_stats_errors_and_single_micro_step() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        MicroStepStats(0)
    stats = MicroStepStats(4)
    with pytest.raises(RuntimeError, match="before any observe"):
        stats.finish_step()
    w = torch.nn.Parameter(torch.zeros(DIM))
    with pytest.raises(ValueError, match="no parameter with a gradient"):
        stats.observe([w])
    _micro_step(w, torch.Generator().manual_seed(1), 4, 1.0)
    stats.observe([w])
    one = stats.finish_step()  # one micro-step: nothing to compare it with
    assert one.grad_variance is None and one.grad_noise_scale is None
    assert one.grad_norm == pytest.approx(float(w.grad.norm()))


def test_gradient_stats_is_a_frozen_record() -> None:
    s = GradientStats(
        step=1,
        level="int8",
        grad_norm=1.0,
        grad_variance=None,
        grad_noise_scale=None,
        comm_bytes=10,
        allreduce_s=0.1,
        local_grad_norm=1.0,
        world_size=2,
        global_batch=None,
    )
    assert s.compression == "int8"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.step = 2  # type: ignore[misc]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("carry", [True, False])
def test_one_rank_hook_reports_no_noise_estimate(one_rank_group, carry: bool) -> None:
    # One rank: the small and the big batch are the same batch, so nothing can be estimated.
    # Carried in float32, 1/n_r reads back as float32(1/3) > 1/3: a gap of 1e-8 between the
    # batch sizes' inverses once made a variance and a noise scale of 0 instead of None.
    from torch.nn.parallel import DistributedDataParallel

    from trainspec.kernels import CompressionHook

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(10, 10))
    hook = CompressionHook("none", local_batch_size=3, carry_statistics=carry)
    hook.register(ddp)
    for _ in range(2):
        ddp.zero_grad()
        ddp(torch.randn(3, 10)).square().mean().backward()
    stats = hook.latest_stats()
    assert stats is not None and stats.world_size == 1 and stats.global_batch == 3
    assert stats.grad_variance is None and stats.grad_noise_scale is None


def test_ema_under_a_changing_loss_scale_equals_the_unscaled_ema() -> None:
    # A GradScaler's scale s multiplies both terms by s^2; smoothed as read, the steps before
    # the scale halved would weigh 4x the ones after until the EMA forgot them.
    steps = [
        NoiseEstimate(true_grad_sq=g, trace_cov=t)
        for g, t in [(1.0, 8.0), (2.0, 4.0), (1.5, 9.0), (0.5, 2.0)]
    ]
    scales = [65536.0, 65536.0, 32768.0, 32768.0]
    plain, scaled, ignored = NoiseScaleEMA(0.5), NoiseScaleEMA(0.5), NoiseScaleEMA(0.5)
    for est, s in zip(steps, scales):
        plain.update(est)
        read = NoiseEstimate(est.true_grad_sq * s * s, est.trace_cov * s * s)
        scaled.update(read, s)
        ignored.update(read)
    assert scaled.value() == pytest.approx(plain.value(), rel=1e-12)
    assert ignored.value() != pytest.approx(plain.value(), rel=1e-3)


def test_noise_scale_terms_are_the_smoothed_pair_behind_the_ratio():
    ema = NoiseScaleEMA(0.5)
    assert ema.terms() is None
    ema.update(NoiseEstimate(true_grad_sq=4.0, trace_cov=8.0))
    ema.update(NoiseEstimate(true_grad_sq=2.0, trace_cov=2.0))
    trace, grad_sq = ema.terms()
    assert (trace, grad_sq) == (5.0, 3.0)
    assert ema.value() == trace / grad_sq


def test_identical_micro_batches_report_no_negative_variance_or_noise_scale() -> None:
    """Ranks (or micro-batches) with the same gradients have tr(Sigma) = 0, which the unbiased
    estimate misses by rounding either way: -5.6e-6 and a noise scale of -2.3e-7 were stored
    from a job without a DistributedSampler, and validate failed the catalogue's minimum 0
    (QA). Reported clamped at 0; the EMA keeps the raw estimate (its mean stays unbiased)."""
    w = torch.nn.Parameter(torch.zeros(DIM))
    stats = MicroStepStats(micro_batch_size=4, loss_divided_by_steps=True)
    for _ in range(20):
        w.grad = None
        for _ in range(4):  # the same batch each micro-step: no variance at all
            ((TRUE_G * 0.1 + 1e-3) @ w * 0.25).backward()
            stats.observe([w])
        s = stats.finish_step()
        assert s.grad_variance is not None and s.grad_variance >= 0
        assert s.grad_noise_scale is None or s.grad_noise_scale >= 0
    ema = NoiseScaleEMA(decay=0.5)
    ema.update(NoiseEstimate(true_grad_sq=1.0, trace_cov=-1e-6))
    assert ema.value() == 0.0 and ema.terms() == (-1e-6, 1.0)


@pytest.mark.parametrize("n", [64, 3 * (1 << 18) + 5], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_squared_norm_of_finite_values_past_float32_range_is_finite(
    n: int, dtype: torch.dtype
) -> None:
    """|t|^2 above 3.4e38 (values about 1e20: each square overflows float32). Before, the
    float32 dot came out infinite, and the hook took the step for a non-finite one."""
    t = torch.linspace(-1, 1, n).mul(1e20).to(dtype)
    want = t.double().pow(2).sum().item()
    got = squared_norm(t)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(want, rel=1e-6)
    small = t * 1e-20  # the fast path's values, as before
    assert squared_norm(small).item() == pytest.approx(small.double().pow(2).sum().item(), rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_squared_norm_of_a_nonfinite_value_is_not_finite(bad: float, dtype: torch.dtype) -> None:
    t = torch.linspace(-1, 1, 1000).mul(1e20).to(dtype)
    t[17] = bad
    assert not torch.isfinite(squared_norm(t))
