"""Codecs of the compression levels (their names: `trainspec.levels`): `none`, `bf16`, `int8[:BLOCK]`, `lowrank:R[:W[:WARM]]`,
`lowrank-bf16:R[:W[:WARM]]` (PowerSGD's factors sent in bfloat16), `topk:F` (the largest
fraction F of each bucket, 0 < F <= 1). WARM is how the first W steps go: `int8` (the
default) or `exact` (uncompressed float32).

`parse_level` validates a level string and `make_codec` builds its codec; both raise
`LevelError` (a ValueError) with a one-line message naming what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable

from trainspec.kernels.codecs.base import Codec, CodecResult
from trainspec.kernels.codecs.bf16 import Bf16Codec
from trainspec.kernels.codecs.int8 import Int8Codec
from trainspec.kernels.codecs.lowrank import FACTOR_DTYPES, LowRankCodec
from trainspec.kernels.codecs.none import NoneCodec
from trainspec.kernels.codecs.topk import TopKCodec
from trainspec.levels import (
    DEFAULT_INT8_BLOCK,
    Level,
    LevelError,
    fraction_of,
    parse_level,
    resolve_level,
)

_BUILDERS: dict[str, Callable[[Level, int], Codec]] = {
    "none": lambda lv, seed: NoneCodec(),
    "bf16": lambda lv, seed: Bf16Codec(),
    "int8": lambda lv, seed: Int8Codec(block_size=lv.param or DEFAULT_INT8_BLOCK),
    "lowrank": lambda lv, seed: LowRankCodec(
        rank=lv.param or 1, warmup_steps=lv.warmup, warmup_kind=lv.warmup_kind, seed=seed
    ),
    "lowrank-bf16": lambda lv, seed: LowRankCodec(
        rank=lv.param or 1,
        warmup_steps=lv.warmup,
        warmup_kind=lv.warmup_kind,
        factor_dtype=FACTOR_DTYPES[lv.kind],
        seed=seed,
    ),
    "topk": lambda lv, seed: TopKCodec(fraction_of(lv)),
}


def make_codec(level: str | Level, *, seed: int = 0) -> Codec:
    """The codec of `level`; `seed` picks the lowrank levels' starting Q (others have no
    random state)."""
    lv = parse_level(level) if isinstance(level, str) else level
    return _BUILDERS[lv.kind](lv, seed)


__all__ = [
    "Bf16Codec",
    "Codec",
    "CodecResult",
    "Int8Codec",
    "Level",
    "LevelError",
    "LowRankCodec",
    "NoneCodec",
    "TopKCodec",
    "make_codec",
    "parse_level",
    "resolve_level",
]
