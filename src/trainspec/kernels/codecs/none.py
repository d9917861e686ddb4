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
        contrib = weighted(grad, weight, residual)
        return wire.all_reduce(contrib).then(lambda f: CodecResult(f.value(), None))
