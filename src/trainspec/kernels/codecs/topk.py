"""Level `topk:F`: each bucket's largest fraction F of values by magnitude, with error feedback.

Sparsification with memory (Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with Memory";
the same scheme as Aji and Heafield 2017 and Lin et al. 2018's Deep Gradient Compression,
without DGC's momentum correction): each rank sends the k = ceil(F n) entries of
`grad * weight + residual` with the largest magnitude, exactly, and keeps every other entry
as its residual, added into the next step. The entries sent are float32, so the residual is
exactly what the sum did not get from this rank, and the running sum of applied updates
stays unbiased.

Why an all-gather: each rank picks its own indices, so there is nothing for an all-reduce to
add position by position. Each rank sends its (value, index) pairs and every rank decodes all
W payloads in rank order, so the sum is bitwise identical everywhere.

Byte cost per rank for n values, W ranks: ``(W - 1) * 8k`` (a float32 value and an int32
index per entry) against ``2 * (W - 1) / W * 4n`` for a float32 ring all-reduce, a ratio of
``W * F``: 2% of float32 for `topk:0.01` at W = 2 (98% saved), 8% at W = 8, and no saving
once W * F reaches 1. Selection is torch's `topk` on CPU and CUDA (the selection is the
cost, and torch's is the one to beat); on CUDA the passes around it run as Triton kernels
when Triton imports (`triton_topk.py`: the weighting, feedback and magnitudes in one pass,
the take-and-clear, the decode's scatter-add), the torch reference otherwise.

An entry that waits in the residual arrives as the sum of every step it waited, up to about
1/F steps of gradient at once. The hook hands the sum back in the bucket's dtype: a float16
bucket under a loss scaler overflows to inf sooner than with the other levels, the scaler
then skips the step, and what those entries carried is lost with it. Keep float16 buckets
on `none`, `bf16` or `int8`, or train in bfloat16 or float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from fractions import Fraction

import torch

from trainspec.kernels.codecs.base import Codec, gathered_sum, weighted
from trainspec.kernels.wire import Wire

log = logging.getLogger("trainspec.kernels")


def kept_entries(n: int, fraction: float) -> int:
    """How many of n values a `topk:fraction` bucket sends: ceil(F n), at least one (none of
    none). Exact in the decimal the level names: ceil(0.07 * 100) is 7, where the float
    product, 7.000000000000001, would give 8."""
    if n <= 0:
        return 0
    return max(1, min(n, math.ceil(Fraction(repr(float(fraction))) * n)))


def select_with_feedback(
    grad: torch.Tensor, weight: float, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = grad * weight + residual -> (the k largest-magnitude values of x (float32), their
    indices (int32), the new residual: x with those entries zeroed)."""
    x = weighted(grad, weight, residual)  # a fresh float32 tensor: it becomes the residual
    indices = torch.topk(x.abs(), k, sorted=False).indices
    values = x[indices]
    x[indices] = 0.0
    return values, indices.to(torch.int32), x


def scatter_accumulate(out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """out[indices] += values, in place. One rank's indices are distinct, so a gather, an add
    and a scatter do it with no atomic adds (deterministic, also under torch's deterministic
    mode, and the same on every rank)."""
    where = indices.to(torch.int64)
    out[where] = out[where] + values


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from trainspec.kernels import triton_topk

    return triton_topk.available()


class TopKCodec(Codec):
    """`backend`: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton"."""

    uses_error_feedback = True

    def __init__(self, fraction: float, backend: str = "auto") -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"topk fraction must be in (0, 1], got {fraction}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"topk backend must be auto, torch or triton, got {backend!r}")
        self.fraction = fraction
        self.backend = backend
        self._kept: dict[int, int] = {}  # bucket size -> entries sent
        self.level = f"topk:{fraction!r}"  # shortest text that parses back to it

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "auto":
            return _triton_usable(device)
        return self.backend == "triton"

    def select(
        self, grad: torch.Tensor, weight: float, residual: torch.Tensor | None, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`select_with_feedback`, on the chosen backend."""
        if self._use_triton(grad.device):
            from trainspec.kernels import triton_topk

            try:  # reads grad and residual only: the reference can start over from them
                x, magnitude = triton_topk.feedback_magnitude(grad, weight, residual)
                values, indices = triton_topk.take_and_clear(
                    x, torch.topk(magnitude, k, sorted=False).indices
                )
                return values, indices, x.view(grad.shape)
            except Exception as exc:  # noqa: BLE001 - an automatic choice falls back
                self._triton_failed(exc)
        return select_with_feedback(grad, weight, residual, k)

    def accumulate(self, out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
        """`scatter_accumulate`, on the chosen backend."""
        if self._use_triton(out.device):
            from trainspec.kernels import triton_topk

            try:  # a kernel that failed to compile or launch wrote nothing
                triton_topk.scatter_add(out, values, indices)
                return
            except Exception as exc:  # noqa: BLE001 - an automatic choice falls back
                self._triton_failed(exc)
        scatter_accumulate(out, values, indices)

    def _triton_failed(self, exc: Exception) -> None:
        """The kernels have not yet run on a GPU (docs/benchmarks.md): where they fail under
        `backend="auto"`, say so once and use the torch reference from then on; a backend
        asked for by name raises."""
        if self.backend != "auto":
            raise exc
        self.backend = "torch"
        log.warning("trainspec: the Triton topk kernels failed (%s: %s); the torch reference "
                    "is used from here on", type(exc).__name__, exc)  # fmt: skip

    def reduce(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        n = grad.numel()
        k = self._kept.get(n)
        if k is None:  # the same few bucket sizes every step
            k = self._kept[n] = kept_entries(n, self.fraction)
        values, indices, new_residual = self.select(grad, weight, residual, k)
        return gathered_sum(wire, n, values, indices, self.accumulate, new_residual, grad)
