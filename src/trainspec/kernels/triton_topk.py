"""Triton kernels for the topk codec: the passes around the selection, fused.

The torch reference (`codecs/topk.py`) makes, per bucket: `weighted` (read grad and residual,
write x), `abs` (read x, write |x|), `topk` over |x|, a gather of the k values, a scatter of
k zeros, an int64 -> int32 cast of the indices; and per rank's payload on decode: an
int32 -> int64 cast, a gather, an add and a scatter. Here:

- `feedback_magnitude`: x = grad * weight + residual and |x| in one pass (one read of x
  fewer than the reference's two ops);
- `take_and_clear`: the k values gathered, their places in x zeroed and the indices narrowed
  to int32, in one launch;
- `scatter_add`: out[indices] += values in one launch, from the int32 indices as they came
  off the wire.

The selection itself stays torch's `topk` (a radix select on CUDA), the one to beat. One
rank's indices are distinct, so no two lanes touch the same place: no atomics, and the
result is the same on every rank and every run.

Same arithmetic, in the same order, as the reference, so the values, residuals and sums
match it to the last bit (tests/unit/test_kernels_triton.py, on CPU under Triton's
interpreter). On a GPU these kernels have not run yet: no GPU was lent in the session that
wrote them, and their throughput is unmeasured (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: absent on CPU-only installs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None

_BLOCK = 1024


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _feedback_magnitude_kernel(
        grad_ptr, res_ptr, x_ptr, mag_ptr, weight, n, BLOCK: tl.constexpr, HAS_RES: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * weight
        if HAS_RES:
            x = x + tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(x_ptr + offs, x, mask=mask)
        tl.store(mag_ptr + offs, tl.abs(x), mask=mask)

    @triton.jit
    def _take_and_clear_kernel(x_ptr, idx_ptr, values_ptr, idx32_ptr, k, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        where = tl.load(idx_ptr + offs, mask=mask, other=0)
        tl.store(values_ptr + offs, tl.load(x_ptr + where, mask=mask, other=0.0), mask=mask)
        tl.store(x_ptr + where, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
        tl.store(idx32_ptr + offs, where.to(tl.int32), mask=mask)

    @triton.jit
    def _scatter_add_kernel(out_ptr, values_ptr, idx_ptr, k, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        where = tl.load(idx_ptr + offs, mask=mask, other=0)
        acc = tl.load(out_ptr + where, mask=mask, other=0.0)
        tl.store(out_ptr + where, acc + tl.load(values_ptr + offs, mask=mask), mask=mask)


def _require() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch reference (backend='torch')")


def _blocks(n: int) -> tuple[int]:
    return (max(1, -(-n // _BLOCK)),)


def feedback_magnitude(
    grad: torch.Tensor, weight: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x = grad * weight + residual in float32, |x|), both fresh and flat."""
    _require()
    grad = grad.reshape(-1).contiguous()
    n = grad.numel()
    x = torch.empty(n, dtype=torch.float32, device=grad.device)
    magnitude = torch.empty_like(x)
    res = residual.reshape(-1).contiguous() if residual is not None else x  # unread when absent
    _feedback_magnitude_kernel[_blocks(n)](
        grad, res, x, magnitude, float(weight), n, BLOCK=_BLOCK, HAS_RES=residual is not None
    )
    return x, magnitude


def take_and_clear(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[indices], indices as int32), and x[indices] = 0 in place. `indices` are distinct."""
    _require()
    indices = indices.contiguous()
    k = indices.numel()
    values = torch.empty(k, dtype=torch.float32, device=x.device)
    narrow = torch.empty(k, dtype=torch.int32, device=x.device)
    if k:
        _take_and_clear_kernel[_blocks(k)](x, indices, values, narrow, k, BLOCK=_BLOCK)
    return values, narrow


def scatter_add(out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """out[indices] += values, in place. `indices` (int32) are distinct."""
    _require()
    k = indices.numel()
    if k:
        _scatter_add_kernel[_blocks(k)](
            out, values.contiguous(), indices.contiguous(), k, BLOCK=_BLOCK
        )
