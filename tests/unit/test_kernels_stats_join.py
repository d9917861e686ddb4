"""The noise-scale estimate of a step some ranks sat out (DDP's join: a rank whose data ran
out sends zero gradients while the others train), from the hook's sums over ranks
(`estimate_over_trained`): a rank with a share of 0 sends 0 to every sum and is no rank of
the estimate."""

from __future__ import annotations

import pytest
import torch

from trainspec.kernels.stats import estimate_noise, estimate_over_trained


def _sums(grads: list[torch.Tensor], shares: list[int], total: int) -> tuple:
    """What the hook's all-reduces give: sum |g_r|^2, sum 1/n_r, the count and samples of
    the ranks with n_r > 0, and |sum_r (n_r / N) g_r|^2 (a zero-share rank sends zeros)."""
    trained = [(g, n) for g, n in zip(grads, shares, strict=True) if n > 0]
    sum_sq = sum(float(g.square().sum()) for g, _ in trained)
    sum_inv = sum(1.0 / n for _, n in trained)
    sent = sum((n / total) * g for g, n in zip(grads, shares, strict=True))
    return sum_sq, sum_inv, len(trained), sum(n for _, n in trained), float(sent.square().sum())


def _direct(grads: list[torch.Tensor], shares: list[int]) -> tuple[float, float]:
    """(tr(Sigma), |G|^2) from the ranks that trained alone: their mean |g_r|^2 and mean
    1 / n_r against the mean gradient of their samples."""
    trained = [(g, n) for g, n in zip(grads, shares, strict=True) if n > 0]
    count, samples = len(trained), sum(n for _, n in trained)
    big = sum(n * g for g, n in trained) / samples
    est = estimate_noise(
        sum(float(g.square().sum()) for g, _ in trained) / count,
        float(big.square().sum()),
        sum(1.0 / n for _, n in trained) / count,
        1.0 / samples,
    )
    assert est is not None
    return est.trace_cov, est.true_grad_sq


def test_a_joined_rank_is_no_rank_of_the_estimate() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(3)]
    shares, total = [4, 3, 2], 9
    grads[2] = torch.zeros(50, dtype=torch.float64)  # rank 2 joined: a shadow pass sends 0
    joined = [4, 3, 0]
    est = estimate_over_trained(*_sums(grads, joined, total), total)
    assert est is not None
    trace, grad_sq = _direct(grads, joined)
    assert est.trace_cov == pytest.approx(trace, rel=1e-12)
    assert est.true_grad_sq == pytest.approx(grad_sq, rel=1e-12)
    # The bug: the joined rank counted as one of 3 with its share and |g|^2 = 0.
    sum_sq, _, _, _, sent_sq = _sums(grads, joined, total)
    counted = estimate_noise(sum_sq / 3, sent_sq, sum(1.0 / n for n in shares) / 3, 1.0 / total)
    assert counted is not None and abs(counted.trace_cov - trace) > 0.1 * abs(trace)


def test_with_every_rank_training_it_is_the_paper_s_estimate() -> None:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(20, generator=gen, dtype=torch.float64) for _ in range(4)]
    shares = [8, 8, 8, 8]
    est = estimate_over_trained(*_sums(grads, shares, 32), 32)
    sum_sq, _, _, _, sent_sq = _sums(grads, shares, 32)
    plain = estimate_noise(sum_sq / 4, sent_sq, 1.0 / 8, 1.0 / 32)
    assert est is not None and plain is not None
    assert est.trace_cov == pytest.approx(plain.trace_cov, rel=1e-12)
    assert est.true_grad_sq == pytest.approx(plain.true_grad_sq, rel=1e-12)


@pytest.mark.parametrize("shares", [[5, 0, 0], [0, 0, 0]])
def test_fewer_than_two_ranks_that_trained_make_no_estimate(shares: list[int]) -> None:
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(10, generator=gen, dtype=torch.float64) * (n > 0) for n in shares]
    assert estimate_over_trained(*_sums(grads, shares, 15), 15) is None


def test_unknown_shares_sent_as_nan_make_no_estimate() -> None:
    # A rank whose share the hook does not know sends NaN for |g_r|^2 (`_stats_scalars`).
    assert estimate_over_trained(float("nan"), 0.5, 2, 4, 1.0, 4) is None
