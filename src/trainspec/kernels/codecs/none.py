"""Level `none`: a plain float32 sum-all-reduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainspec.kernels.codecs.base import Codec, CodecResult, weighted
from trainspec.kernels.wire import Wire


class NoneCodec(Codec):
    level = "none"
    launches_at_once = True

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
        if grad.dtype == torch.float32:
            # Scaled in place, as DDP's own all-reduce hook divides its bucket in place: no
            # copy of the bucket per step (the hook passes DDP's bucket buffer).
            contrib = grad.mul_(weight)
            if residual is not None:
                contrib.add_(residual)
        else:
            contrib = weighted(grad, weight, residual)
        return wire.all_reduce(contrib, then=lambda summed: CodecResult(summed, None))
