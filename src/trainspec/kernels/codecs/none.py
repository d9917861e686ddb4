"""Level `none`: a plain sum-all-reduce, in float32 (float64 for a float64 model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainspec.kernels.codecs.base import CarryingCodec, CodecResult, weighted
from trainspec.kernels.wire import Wire

# The largest bucket whose carrier (a float32 copy, kept between steps) is worth it: above DDP's
# default 25 MiB buckets. DDP's first step hands the whole model over as one bucket; a large
# model's statistics then go in an all-reduce of their own for that step rather than in a
# second whole-gradient buffer.
CARRY_MAX_ELEMENTS = 8 * 2**20  # 32 MiB of float32


class NoneCodec(CarryingCodec):
    keeps_float64 = True
    level = "none"
    launches_at_once = True

    def __init__(self) -> None:
        # bucket key -> a float32 buffer of the bucket plus the carried values, reused each
        # step: DDP copies a hook's result into the gradients before the next backward.
        # One entry at most (the last bucket's; see `reduce_carrying`).
        self._carriers: dict[int, torch.Tensor] = {}

    def reduce(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        # A residual left by a previous lossy level is flushed here, sent exactly once.
        if grad.dtype in (torch.float32, torch.float64):
            # Scaled in place, as DDP's own all-reduce hook divides its bucket in place: no
            # copy of the bucket per step (the hook passes DDP's bucket buffer). A float64
            # model stays float64, as with DDP's own hook (it was rounded to float32).
            contrib = grad.mul_(weight)
            if residual is not None:
                contrib.add_(residual)
        else:
            contrib = weighted(grad, weight, residual)
        return wire.all_reduce(contrib, then=lambda summed: CodecResult(summed, None))

    def can_carry(self, grad: torch.Tensor) -> bool:
        return grad.dtype == torch.float32 and grad.numel() <= CARRY_MAX_ELEMENTS

    def reduce_carrying(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        extra: torch.Tensor,
    ) -> torch.futures.Future:
        # The scaling writes into the carrier instead of in place: the same one pass over
        # the bucket, and the extra values go in the same all-reduce, not one of their own.
        n = grad.numel()
        size = n + extra.numel()
        buf = self._carriers.get(key)
        if buf is None or buf.numel() != size or buf.device != grad.device:
            # Only the step's last bucket carries, and DDP's first step has one bucket of the
            # whole model before it rebuilds them: keep the current carrier alone, or that
            # whole-model buffer would stay allocated under another key for the whole run.
            self._carriers.clear()
            buf = torch.empty(size, dtype=torch.float32, device=grad.device)
            self._carriers[key] = buf
        contrib = torch.mul(grad, weight, out=buf[:n])
        if residual is not None:
            contrib.add_(residual)
        buf[n:].copy_(extra)
        return wire.all_reduce(buf, then=lambda summed: CodecResult(summed[:n], None, summed[n:]))
