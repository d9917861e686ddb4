"""The codec contract: turn this rank's weighted gradient into the sum over ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainspec.kernels.wire import Wire, follow, future_devices


@dataclass(frozen=True)
class CodecResult:
    """What one bucket's exchange produced.

    `summed`: the decoded sum over ranks of every rank's contribution (float32, flat).
    `residual`: this rank's error-feedback residual (contribution minus what the sum
    credited to it), or None when the codec sends the contribution exactly enough that no
    feedback is kept. Summed over ranks, the residuals are exactly what the sum is missing,
    so adding them into the next step keeps the running sum of applied updates unbiased
    (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD").
    `extra`: the sum over ranks of the values `reduce_carrying` sent beside the bucket.
    """

    summed: torch.Tensor
    residual: torch.Tensor | None
    extra: torch.Tensor | None = None


class Codec(ABC):
    """One compression level. Instances hold per-bucket state (e.g. PowerSGD's warm start).

    `reduce` must issue the same collectives, in the same order, with the same shapes on
    every rank, and may only launch further collectives from continuations of its own
    futures (the hook serialises buckets, so that order is the same everywhere).
    """

    level: str
    uses_error_feedback: bool = False
    # True when `reduce` launches every collective it needs before returning (none, bf16).
    # The hook then launches such buckets as DDP hands them over, in bucket order on every
    # rank, instead of threading them through one future chain (which multi-round codecs
    # need, as their later rounds start from continuations).
    launches_at_once: bool = False
    # True when a float64 bucket is reduced in float64 (`none`); the others encode in float32
    # (`weighted`), where a finite float64 value past float32's range is an infinity.
    keeps_float64: bool = False
    # True when `reduce` reads `shapes` (lowrank plans its matrices by them); the hook
    # works them out per bucket only for such a codec.
    plans_by_shape: bool = False

    @abstractmethod
    def reduce(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        """Exchange `grad * weight + residual`; the future's value is a `CodecResult`.

        `grad` is a flat float tensor (the hook passes DDP's bucket buffer). A level that
        sends it exactly (`none`) may scale it in place, as DDP's own all-reduce hook does;
        every other level leaves it unmodified. `shapes` are the shapes of the
        parameters packed into it, in order (codecs that ignore structure may ignore it); a
        complex parameter's is its real view's, as the bucket holds two floats a value
        (`residual_layout.bucket_shapes`).
        """

    def reduce_shadow(
        self,
        grad: torch.Tensor,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        """`reduce` for a rank in a shadow pass of DDP's `join()` (its data ran out; the
        others still train): the same collectives with the same shapes as the other ranks'
        `reduce`, and a contribution that decodes to exactly 0, so the sum is bitwise what
        the ranks that trained send (adding 0.0 changes no float but the sign of a zero).
        The result's residual is not this rank's: it trained nothing, so the hook keeps the
        error feedback it had.

        Here: `reduce` of zeros with no residual. Every level's encoding of zeros decodes to
        zeros (int8: codes 0, times the scale 1 of an all-zero block; topk: k zero values),
        and no level sends anything else of a rank's own; a codec whose sum shares something
        out by the number of ranks (lowrank's error-feedback credit) overrides this."""
        zeros = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        return self.reduce(zeros, 0.0, None, key, wire, shapes)

    def reset(self) -> None:  # noqa: B027 - stateless codecs have nothing to reset
        """Forget per-bucket state (warm starts); error feedback lives in the hook."""

    def forget_warm_starts(self) -> None:
        """Drop state carried from step to step that a non-finite step may have filled with
        NaN (warm starts), keeping the codec's place in its schedule (warm-up steps)."""
        self.reset()


class CarryingCodec(Codec):
    """A level whose collective can also sum a few float32 values beside the bucket, exactly
    enough for the hook's statistics (so they need no collective of their own). One
    collective a bucket, launched in `reduce_carrying` itself."""

    launches_at_once = True

    @abstractmethod
    def can_carry(self, grad: torch.Tensor) -> bool:
        """True when `reduce_carrying` can take this bucket."""

    @abstractmethod
    def reduce_carrying(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        extra: torch.Tensor,
    ) -> torch.futures.Future:
        """`reduce`, with `extra` (float32, flat) summed over ranks in the same collective
        and returned as `CodecResult.extra`. Only where `can_carry(grad)`."""


def weighted(
    grad: torch.Tensor,
    weight: float,
    residual: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """grad * weight + residual, computed in float32, as `dtype`. Without a residual the
    product is rounded once straight into a new `dtype` tensor: one pass over the bucket
    for a narrower `dtype` (a float32 product, then a cast, read and wrote it twice)."""
    contrib = grad.to(torch.float32)
    if residual is None:
        out = torch.empty(contrib.shape, dtype=dtype, device=contrib.device)
        return torch.mul(contrib, weight, out=out)
    contrib = contrib * weight
    contrib += residual
    return contrib.to(dtype)


def gathered_sum(
    wire: Wire,
    n: int,
    head: torch.Tensor,
    tail: torch.Tensor,
    add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    residual: torch.Tensor | None,
    like: torch.Tensor,
) -> torch.futures.Future:
    """Sum a payload that ranks cannot add on the wire (each rank's own scales, or its own
    indices): every rank's `head` and `tail` go out as one byte buffer by an all-gather,
    and each rank calls `add(out, head, tail)` for every rank's pair, in rank order, into a
    float32 sum of n values on `like`'s device, so the sum is bitwise the same everywhere.
    `head` goes first: a float32 head keeps a 4-byte tail aligned on the receiving side."""
    head_bytes = head.numel() * head.element_size()
    packed = torch.cat([head.reshape(-1).view(torch.uint8), tail.reshape(-1).view(torch.uint8)])

    def decode(payloads: list[torch.Tensor]) -> CodecResult:
        out = torch.zeros(n, dtype=torch.float32, device=like.device)
        for payload in payloads:
            add(out, payload[:head_bytes].view(head.dtype), payload[head_bytes:].view(tail.dtype))
        return CodecResult(out, residual)

    return follow(wire.all_gather(packed), decode, future_devices(like))
