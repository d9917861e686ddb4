"""Triton kernels for the int8 codec: fused quantise + error feedback, fused dequantise + add.

Same arithmetic, in the same order, as the torch reference in `codecs/int8.py`, so results
match it to the last bit on the interpreter and to float32 rounding on a GPU. Used
automatically for CUDA tensors when Triton imports; the torch reference is the fallback.

Verification: on CPU under Triton's interpreter (`TRITON_INTERPRET=1`,
tests/unit/test_kernels_triton.py), and on an H100 (tests/gpu/test_cuda_paths.py: codes and
scales identical to the reference, residuals within 1.5e-7; `bench/codec_throughput.py`: 93%
of copy bandwidth to encode, 95% to decode, docs/benchmarks.md).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: absent on CPU-only installs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _quantize_feedback_kernel(
        grad_ptr,
        res_ptr,
        codes_ptr,
        scales_ptr,
        new_res_ptr,
        weight,
        n,
        BLOCK: tl.constexpr,
        HAS_RES: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * weight
        if HAS_RES:
            x = x + tl.load(res_ptr + offs, mask=mask, other=0.0)
        scale = tl.max(tl.abs(x), axis=0) / 127.0
        scale = tl.where(scale == 0, 1.0, scale)  # an inf scale stays (int8.py)
        # tl.max may pass over a NaN (the GPU's max does): a NaN sum makes the scale NaN, so
        # a block holding one decodes to NaN, as in the torch reference, not to finite codes.
        nan_sum = tl.sum(tl.where(x != x, x, 0.0), axis=0)
        scale = tl.where(nan_sum == nan_sum, scale, nan_sum)
        codes = tl.floor(x / scale + 0.5)
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
        tl.store(codes_ptr + offs, codes.to(tl.int8), mask=mask)
        tl.store(scales_ptr + pid, scale)
        tl.store(new_res_ptr + offs, x - codes * scale, mask=mask)

    @triton.jit
    def _dequantize_accumulate_kernel(out_ptr, codes_ptr, scales_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        scale = tl.load(scales_ptr + pid)
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32)
        acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc + codes * scale, mask=mask)


def _require(block_size: int) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch reference (backend='torch')")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"Triton int8 kernels need a power-of-two block size, got {block_size}")


def quantize_with_feedback(
    grad: torch.Tensor, weight: float, residual: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _require(block_size)
    grad = grad.contiguous()
    n = grad.numel()
    nb = -(-n // block_size)
    codes = torch.empty(n, dtype=torch.int8, device=grad.device)
    scales = torch.empty(nb, dtype=torch.float32, device=grad.device)
    new_res = torch.empty(n, dtype=torch.float32, device=grad.device)
    res = residual.contiguous() if residual is not None else new_res  # unread when absent
    _quantize_feedback_kernel[(nb,)](
        grad,
        res,
        codes,
        scales,
        new_res,
        float(weight),
        n,
        BLOCK=block_size,
        HAS_RES=residual is not None,
    )
    return codes, scales, new_res


def dequantize_accumulate(
    out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int
) -> None:
    _require(block_size)
    n = out.numel()
    nb = -(-n // block_size)
    _dequantize_accumulate_kernel[(nb,)](
        out, codes.contiguous(), scales.contiguous(), n, BLOCK=block_size
    )
