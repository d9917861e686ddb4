"""Gradient statistics: norm, variance across ranks, gradient noise scale.

From two squared norms, McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", appendix A): with |G_small|^2 measured on small batches and |G_big|^2 on the big
one, E|G_b|^2 = |G|^2 + tr(Sigma) / b, so two batch sizes give unbiased estimates of
|G|^2 and of tr(Sigma), the trace of the per-sample gradient covariance, and their ratio
B_simple = tr(Sigma) / |G|^2. As the paper advises, numerator and denominator are smoothed
separately by an exponential moving average before dividing.

Generalised to unequal small batches (uneven shares n_r): averaging |g_r|^2 over ranks
gives |G|^2 + tr(Sigma) * mean_r(1 / n_r), and the weighted full batch of N samples gives
|G|^2 + tr(Sigma) / N; with equal shares this is the paper's B_small = N / W, B_big = N.
Ranks that trained nothing in a step (DDP's join: a rank whose data ran out shadows the
others' steps with zero gradients) are no small batch of it, and the big batch is the samples
the others trained (`estimate_over_trained`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_DOT_CHUNK = 1 << 18  # elements per float32 dot product; the chunks are summed in float64


def squared_norm(t: Any) -> Any:
    """|t|^2 as a float64 0-d tensor on t's device. On the CPU finite whenever t is (a float32
    value above 1.8e19 squares past float32's 3.4e38), so there a non-finite result means t
    held a NaN or an infinity (the hook's test of a non-finite step).

    Float32 tensors: float32 BLAS dot products over chunks of 2^18 elements, summed in
    float64. One dot over the whole tensor drifts low as it grows (2e-6 at 0.47 M elements,
    1.2e-4 at 6.5 M, 2.8e-3 at 50 M on this machine's MKL); chunked, the error stayed under
    1e-6 at every size from 0.47 M to 50 M, at the cost of one dot. That is 0.05 ms on a
    0.47 M-element bucket on one CPU thread, against 0.23 ms for `vector_norm(dtype=float64)`
    (which copies the tensor to float64 first; 28 ms at 6.5 M) and 3.9 ms for a float64 copy
    then `pow(2).sum()`, twice per bucket on the training and gloo threads. With a relative
    error e on each norm, the noise-scale estimate's tr(Sigma) is off by about e * 2B /
    B_noise of itself and |G|^2 by about e * (1 + B_noise / B): negligible unless the noise
    scale is below a few e of the batch. Float64 tensors: the same in float64; half
    precision accumulates in float64 (`vector_norm`), as a half-precision dot would lose
    the sum.

    Overflow: on the CPU, a float32 sum that comes out infinite is computed again
    accumulating in float64 (the check reads a host value: no wait). On CUDA it is not:
    the check would wait for the device every bucket, and the float64 path reads and writes
    the bucket five times over where the dot reads it once, on the GPU-bound job's own
    stream. So on CUDA a finite float32 gradient with values past about 1.8e19 reads as a
    non-finite step: the hook then rolls error feedback back as for a NaN, so a residual
    this applied step carried is applied once more. That is a run that has already
    diverged; the CPU case is tested, the CUDA one is not (no GPU in that session).
    """
    import torch

    if t.dtype in (torch.float32, torch.float64):
        chunks = t.reshape(-1).split(_DOT_CHUNK)
        if len(chunks) == 1:
            sq = torch.dot(chunks[0], chunks[0]).to(torch.float64)
        else:
            sq = torch.stack([torch.dot(c, c) for c in chunks]).to(torch.float64).sum()
        if t.dtype == torch.float64 or t.device.type != "cpu" or not math.isinf(sq.item()):
            return sq
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


@dataclass(frozen=True)
class GradientStats:
    """One optimizer step's statistics, as one rank saw them. Read-only.

    `grad_variance` is the estimate of tr(Sigma) (per-sample covariance trace) and
    `grad_noise_scale` the EMA-smoothed B_simple, in samples; both are None when they cannot
    be estimated (one rank, unknown batch sizes, or a not-yet-positive EMA of |G|^2).
    `comm_bytes` are the bytes this rank sent this step, `allreduce_s` the time from the
    first bucket's launch to the last bucket's completion.
    """

    step: int
    level: str
    grad_norm: float
    grad_variance: float | None
    grad_noise_scale: float | None
    comm_bytes: int
    allreduce_s: float
    local_grad_norm: float
    world_size: int
    global_batch: int | None
    last_bucket_ready: float | None = None  # perf_counter when DDP handed over the last bucket
    # The noise-scale EMA's smoothed (tr(Sigma), |G|^2) after this step (`NoiseScaleEMA.terms`):
    # what several models' statistics combine from, whenever they are read.
    noise_terms: tuple[float, float] | None = None

    @property
    def compression(self) -> str:
        """The level, under the name the runtime's step record uses."""
        return self.level


def nonnegative(value: float | None) -> float | None:
    """An estimate of a nonnegative quantity as reported: tr(Sigma) and the noise scale from
    unbiased estimates come out below 0 where the ranks' gradients are (nearly) the same (no
    DistributedSampler: float32 rounding left -5.6e-6, under the catalogue's floor of 0). The
    EMAs keep the raw estimates, so their mean stays unbiased; NaN stays NaN."""
    if value is None or not value < 0:
        return value
    return 0.0


@dataclass(frozen=True)
class NoiseEstimate:
    true_grad_sq: float  # unbiased estimate of |G|^2
    trace_cov: float  # unbiased estimate of tr(Sigma)


def estimate_noise(
    small_sq: float, big_sq: float, inv_small_batch: float, inv_big_batch: float
) -> NoiseEstimate | None:
    """Solve small = G2 + S * inv_small, big = G2 + S * inv_big for (G2, S)."""
    gap = inv_small_batch - inv_big_batch
    if not gap > 0 or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
        return None
    trace_cov = (small_sq - big_sq) / gap
    true_grad_sq = (inv_small_batch * big_sq - inv_big_batch * small_sq) / gap
    return NoiseEstimate(true_grad_sq, trace_cov)


def estimate_over_trained(
    sum_sq: float,
    sum_inv: float,
    trained_ranks: int,
    trained: float,
    sent_sq: float,
    global_batch: int,
) -> NoiseEstimate | None:
    """The estimate of one step from the hook's sums over ranks, counting only the ranks that
    trained samples (n_r > 0): a rank that sat the step out (a shadow pass of DDP's join, or
    a share of 0) sends n_r = 0 and adds nothing to any sum.

    `sum_sq` = sum of |g_r|^2 and `sum_inv` = sum of 1 / n_r over the `trained_ranks` ranks
    that trained, `trained` = the sum of their n_r, `sent_sq` = |sum_r (n_r / N) g_r|^2 for
    the sum the ranks sent, each weighed by its share of the `global_batch` N. The big
    batch is the `trained` samples, whose mean gradient is N / trained times that sum; the
    small batches are the ranks that trained. None for fewer than two such ranks (one rank
    has one batch size) or nothing trained."""
    if trained_ranks < 2 or not trained > 0 or not global_batch:
        return None
    to_big = global_batch / trained
    return estimate_noise(
        sum_sq / trained_ranks, sent_sq * to_big * to_big, sum_inv / trained_ranks, 1.0 / trained
    )


class NoiseScaleEMA:
    """EMA of tr(Sigma) and |G|^2 separately, then their ratio (McCandlish et al., A.1)."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"noise-scale EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._trace: float | None = None
        self._grad_sq: float | None = None

    def update(self, est: NoiseEstimate, loss_scale: float | None = None) -> float | None:
        """Fold in one step's estimate. `loss_scale`: the GradScaler scale s its gradients
        were read at (both terms are then s^2 too large). Each is smoothed in the gradient's
        own units, or a step read at 65,536 would outweigh one read after the scale halved by
        4x until the EMA forgot it; the ratio of one step alone does not depend on s."""
        if loss_scale is not None and loss_scale > 0 and loss_scale != 1.0:
            inv = 1.0 / (loss_scale * loss_scale)
            est = NoiseEstimate(est.true_grad_sq * inv, est.trace_cov * inv)
        d = self.decay
        if self._trace is None or self._grad_sq is None:
            self._trace, self._grad_sq = est.trace_cov, est.true_grad_sq
        else:
            self._trace = d * self._trace + (1 - d) * est.trace_cov
            self._grad_sq = d * self._grad_sq + (1 - d) * est.true_grad_sq
        return self.value()

    def value(self) -> float | None:
        if self._trace is None or self._grad_sq is None or self._grad_sq <= 0:
            return None
        return nonnegative(self._trace / self._grad_sq)

    def terms(self) -> tuple[float, float] | None:
        """The smoothed (tr(Sigma), |G|^2), or None before the first estimate. Both add over
        disjoint sets of parameters: two models' noise scale is their sums' ratio."""
        if self._trace is None or self._grad_sq is None:
            return None
        return self._trace, self._grad_sq

    def reset(self) -> None:
        self._trace = self._grad_sq = None
