from __future__ import annotations

import pytest
import torch

from trainspec.kernels import LevelError, make_codec, parse_level
from trainspec.kernels.codecs import (
    Bf16Codec,
    Int8Codec,
    Level,
    LowRankCodec,
    NoneCodec,
    TopKCodec,
)


@pytest.mark.parametrize(
    ("text", "level", "codec_type"),
    [
        ("none", Level("none"), NoneCodec),
        ("bf16", Level("bf16"), Bf16Codec),
        ("int8", Level("int8", 256), Int8Codec),
        ("INT8:64", Level("int8", 64), Int8Codec),
        (" lowrank:4 ", Level("lowrank", 4), LowRankCodec),
        ("lowrank:4:24", Level("lowrank", 4, 24), LowRankCodec),
        ("lowrank:4:0", Level("lowrank", 4), LowRankCodec),
        ("lowrank-bf16:12", Level("lowrank-bf16", 12), LowRankCodec),
        ("LOWRANK-BF16:12:15", Level("lowrank-bf16", 12, 15), LowRankCodec),
        ("lowrank:6:3:exact", Level("lowrank", 6, 3, "exact"), LowRankCodec),
        ("LOWRANK-BF16:12:3:EXACT", Level("lowrank-bf16", 12, 3, "exact"), LowRankCodec),
        ("lowrank:4:24:int8", Level("lowrank", 4, 24), LowRankCodec),
        ("lowrank:4:0:exact", Level("lowrank", 4), LowRankCodec),  # no warm-up to send
        ("topk:0.01", Level("topk", fraction=0.01), TopKCodec),
        (" TOPK:.5 ", Level("topk", fraction=0.5), TopKCodec),
        ("topk:1", Level("topk", fraction=1.0), TopKCodec),
        ("topk:1e-3", Level("topk", fraction=0.001), TopKCodec),
    ],
)
def test_valid_levels_parse_and_build(text: str, level: Level, codec_type: type) -> None:
    assert parse_level(text) == level
    codec = make_codec(text)
    assert isinstance(codec, codec_type)
    assert codec.level == str(level)


def test_level_names_round_trip() -> None:
    for text in (
        "none",
        "bf16",
        "int8",
        "int8:64",
        "lowrank:2",
        "lowrank:4:24",
        "lowrank-bf16:2",
        "lowrank-bf16:12:15",
        "lowrank:6:3:exact",
        "lowrank-bf16:12:3:exact",
        "topk:0.01",
        "topk:1.0",
    ):
        assert str(parse_level(text)) == text


def test_codec_block_and_rank_come_from_the_level() -> None:
    codec = make_codec("int8:128")
    assert isinstance(codec, Int8Codec) and codec.block_size == 128
    low = make_codec("lowrank:3")
    assert isinstance(low, LowRankCodec) and low.rank == 3 and low.warmup_steps == 0
    warm = make_codec("lowrank:4:24")
    assert isinstance(warm, LowRankCodec) and (warm.rank, warm.warmup_steps) == (4, 24)
    assert warm.factor_dtype == torch.float32
    half = make_codec("lowrank-bf16:12:15")
    assert isinstance(half, LowRankCodec) and (half.rank, half.warmup_steps) == (12, 15)
    assert half.factor_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("int4", "unknown compression level 'int4'"),
        ("lowrank", "needs a rank"),
        ("lowrank:0", "positive integer"),
        ("lowrank:x", "positive integer"),
        ("lowrank:4:", "warm-up steps"),
        ("lowrank:4:x", "warm-up steps"),
        ("lowrank:4:²", "warm-up steps"),  # str.isdigit would take these
        ("lowrank:٣", "positive integer"),
        ("int8:²", "positive integer"),
        ("lowrank::24", "positive integer"),
        ("lowrank-bf16", "'lowrank-bf16' needs a rank"),
        ("lowrank-bf16:0", "positive integer"),
        ("lowrank-bf16:4:x", "'lowrank-bf16': warm-up steps"),
        ("lowrank:4:bf16", "warm-up steps"),  # the factor format is the kind, not a suffix
        ("lowrank:4:3:fp32", "warm-up must be int8 or exact, got 'fp32'"),
        ("lowrank:4:3:", "warm-up must be int8 or exact"),
        ("lowrank:4:3:exact:1", "warm-up must be int8 or exact"),
        ("lowrank-fp16:4", "unknown compression level"),
        ("int8:-3", "positive integer"),
        ("int8:67108864", "block size must be at most 65536, got 67108864"),
        ("none:2", "takes no parameter"),
        ("topk", "'topk' needs a fraction"),
        ("topk:0", "in \\(0, 1\\], got '0'"),
        ("topk:1.5", "in \\(0, 1\\], got '1.5'"),
        ("topk:nan", "got 'nan'"),
        ("topk:inf", "got 'inf'"),
        ("topk:-0.1", "got '-0.1'"),
        ("topk:0.1:2", "got '0.1:2'"),
        ("topk:٠.5", "in \\(0, 1\\]"),  # float() would take Arabic-Indic digits
        ("topk:1e-400", "got '1e-400'"),  # 0 once parsed
        ("", "unknown compression level"),
    ],
)
def test_bad_levels_raise_one_line_errors(text: str, fragment: str) -> None:
    with pytest.raises(LevelError, match=fragment) as info:
        parse_level(text)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_the_block_an_int8_level_names_wins_over_the_configured_one() -> None:
    """`int8:64` was built with kernels.int8_block_size (256 by default) whatever it said."""
    from types import SimpleNamespace

    from trainspec.kernels.hook import configured_level

    def level(compression: str, block: int) -> str:
        config = SimpleNamespace(compression=compression, int8_block_size=block)
        return str(configured_level(config))

    assert level("int8:64", 256) == "int8:64"
    assert level("int8", 128) == "int8:128"
    assert level(" INT8 ", 64) == "int8:64"
    assert level("int8:256", 64) == "int8"  # the name of block 256 in any job
    assert level("lowrank:2", 128) == "lowrank:2"


def test_a_topk_level_without_its_fraction_does_not_build() -> None:
    with pytest.raises(LevelError, match="needs a fraction"):
        make_codec(Level("topk"))


def test_non_string_level_is_rejected() -> None:
    with pytest.raises(LevelError, match="must be a string"):
        parse_level(8)  # type: ignore[arg-type]


def test_bad_codec_arguments() -> None:
    with pytest.raises(ValueError, match="block size"):
        Int8Codec(block_size=0)
    with pytest.raises(ValueError, match="backend"):
        Int8Codec(backend="cuda")
    with pytest.raises(ValueError, match="rank"):
        LowRankCodec(rank=0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        LowRankCodec(rank=2, factor_dtype=torch.float16)


@pytest.mark.parametrize("text", ["lowrank:" + "9" * 5000, "lowrank:4:" + "9" * 5000,
                                  "int8:" + "9" * 5000, "int8:1234567890"])  # fmt: skip
def test_a_number_too_long_for_a_level_is_a_level_error(text) -> None:
    """int() of over 4300 digits raises a ValueError of its own: the agent answered 500."""
    with pytest.raises(LevelError, match="at most 9 digits"):
        parse_level(text)
