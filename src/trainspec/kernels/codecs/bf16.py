"""Level `bf16`: cast to bfloat16, sum-all-reduce in bfloat16, widen back.

Half the bytes of float32. No error feedback: bfloat16 keeps float32's exponent, and the
sum itself is rounded on the wire (gloo and NCCL add in bf16), which a local residual could
not account for anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainspec.kernels.codecs.base import Codec, CodecResult, weighted
from trainspec.kernels.wire import Wire


class Bf16Codec(Codec):
    level = "bf16"
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
        payload = weighted(grad, weight, residual, torch.bfloat16)  # one pass (no residual)
        return wire.all_reduce(
            payload, then=lambda summed: CodecResult(summed.to(torch.float32), None)
        )
