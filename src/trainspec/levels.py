"""Compression levels by name, without torch: `none`, `bf16`, `int8[:BLOCK]`,
`lowrank:R[:W[:WARM]]`, `lowrank-bf16:R[:W[:WARM]]`, `topk:F`. `parse_level` reads one
(`LevelError`, a one-line ValueError, otherwise) and `resolve_level` gives a plain `int8` the
job's block. The kernels build codecs from these (`kernels.codecs.make_codec`); the
configuration's rules (`LEVEL_RULES`, for `load_config(extra_rules=)`), the CLI and the agent
check names with them and import no torch, so `trainspec config`, `run` and the agent start
without it (the kernels' package took 3 s to import here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from trainspec.config import Rule  # config_rules.Rule, the one config surface

WARMUP_KINDS = ("int8", "exact")  # how a lowrank level's warm-up steps are sent

DEFAULT_INT8_BLOCK = 256
# Every bucket is padded to whole blocks: a block of 2^26 made a small model's steps 200x
# slower, one of 10^9 ran out of memory in backward.
MAX_INT8_BLOCK = 1 << 16


class LevelError(ValueError):
    """A compression level string that does not name a level."""


@dataclass(frozen=True)
class Level:
    kind: str  # none | bf16 | int8 | lowrank | lowrank-bf16 | topk
    param: int | None = None  # int8: block size; lowrank(-bf16): rank
    warmup: int = 0  # lowrank(-bf16): steps before PowerSGD starts
    warmup_kind: str = "int8"  # lowrank(-bf16): how those steps are sent: int8 | exact
    fraction: float | None = None  # topk: the share of each bucket's values sent

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk:{self.fraction!r}"
        if self.kind == "int8" and self.param in (None, DEFAULT_INT8_BLOCK):
            return "int8"
        if self.warmup:
            suffix = "" if self.warmup_kind == "int8" else f":{self.warmup_kind}"
            return f"{self.kind}:{self.param}:{self.warmup}{suffix}"
        return self.kind if self.param is None else f"{self.kind}:{self.param}"


def _no_param(kind: str) -> Callable[[str | None], Level]:
    def parse(arg: str | None) -> Level:
        if arg is not None:
            raise LevelError(f"compression level {kind!r} takes no parameter, got {arg!r}")
        return Level(kind)

    return parse


# Not str.isdigit, which takes '²' and '٣'; at most 9 digits: int() of over 4300 raises a
# ValueError of its own (the agent answered 500 to such a level).
_ASCII_INT = re.compile(r"[0-9]{1,9}")


def _int_param(
    kind: str, what: str, default: int | None, maximum: int | None = None
) -> Callable[[str | None], Level]:
    def parse(arg: str | None) -> Level:
        if arg is None:
            if default is None:
                raise LevelError(f"compression level {kind!r} needs a {what}, e.g. {kind}:4")
            return Level(kind, default)
        if not _ASCII_INT.fullmatch(arg) or int(arg) < 1:
            raise LevelError(
                f"compression level {kind!r}: {what} must be a positive integer (at most 9 digits), "
                f"got {arg!r}"
            )
        if maximum is not None and int(arg) > maximum:
            raise LevelError(
                f"compression level {kind!r}: {what} must be at most {maximum}, got {arg}"
            )
        return Level(kind, int(arg))

    return parse


def _lowrank(kind: str) -> Callable[[str | None], Level]:
    """`R`, `R:W` or `R:W:WARM`: rank R, after W warm-up steps (0 when left out) sent as
    WARM: `int8` (the default) or `exact`."""

    def parse(arg: str | None) -> Level:
        rank_text, sep, rest = (arg or "").partition(":")
        rank = _int_param(kind, "rank", None)(rank_text if arg is not None else None)
        if not sep:
            return rank
        warm_text, sep_kind, warm_kind = rest.partition(":")
        if not _ASCII_INT.fullmatch(warm_text):
            raise LevelError(
                f"compression level {kind!r}: warm-up steps must be a non-negative integer (at most "
                "9 digits), "
                f"got {warm_text!r}"
            )
        if sep_kind and warm_kind not in WARMUP_KINDS:
            raise LevelError(
                f"compression level {kind!r}: warm-up must be {' or '.join(WARMUP_KINDS)}, "
                f"got {warm_kind!r}"
            )
        steps = int(warm_text)
        return Level(kind, rank.param, steps, warm_kind if sep_kind and steps else "int8")

    return parse


# A plain decimal: 0.01, .5, 1, 1e-3 (no sign, no 'nan' or 'inf', which float() would take).
_ASCII_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _topk(arg: str | None) -> Level:
    """`F`: the fraction of each bucket's values sent, 0 < F <= 1."""
    if arg is None:
        raise LevelError("compression level 'topk' needs a fraction, e.g. topk:0.01")
    fraction = float(arg) if _ASCII_DECIMAL.fullmatch(arg) else math.nan
    if not 0.0 < fraction <= 1.0:
        raise LevelError(
            f"compression level 'topk': the fraction must be a number in (0, 1], got {arg!r}"
        )
    return Level("topk", fraction=fraction)


_PARSERS: dict[str, Callable[[str | None], Level]] = {
    "none": _no_param("none"),
    "bf16": _no_param("bf16"),
    "int8": _int_param("int8", "block size", DEFAULT_INT8_BLOCK, MAX_INT8_BLOCK),
    "lowrank": _lowrank("lowrank"),
    "lowrank-bf16": _lowrank("lowrank-bf16"),
    "topk": _topk,
}


def fraction_of(level: Level) -> float:
    """A topk level's fraction; LevelError for a `Level` built without one."""
    if level.fraction is None:
        raise LevelError("compression level 'topk' needs a fraction, e.g. topk:0.01")
    return level.fraction


def parse_level(text: str) -> Level:
    """'none' | 'bf16' | 'int8' | 'int8:B' | 'lowrank:R' | 'lowrank:R:W' |
    'lowrank:R:W:int8' | 'lowrank:R:W:exact' -> Level.

    'lowrank-bf16:...' are the lowrank levels with bf16 factors; 'topk:F' sends the
    largest fraction F of each bucket.
    """
    if not isinstance(text, str):
        raise LevelError(f"compression level must be a string, got {type(text).__name__}")
    kind, sep, arg = text.strip().lower().partition(":")
    parser = _PARSERS.get(kind)
    if parser is None:
        raise LevelError(
            f"unknown compression level {text!r}; expected one of {', '.join(_PARSERS)}"
        )
    return parser(arg if sep else None)


def resolve_level(text: str, int8_block: int | None = None) -> Level:
    """`parse_level`, with a plain `int8` (no `:B`) taking the job's block size `int8_block`
    (`kernels.int8_block_size`) where one is given. `int8:B` keeps its own block. The result's
    `str()` names the block whenever it is not 256, so it reads the same in any job."""
    level = parse_level(text)
    if level.kind == "int8" and int8_block is not None and ":" not in text:
        return Level("int8", int(int8_block))
    return level


def level_error(text: str) -> str | None:
    """Why `text` names no level (`parse_level`'s message), or None when it names one."""
    try:
        parse_level(text)
    except LevelError as exc:
        return str(exc)
    return None


def is_level(text: str) -> bool:
    return level_error(text) is None


def ladder_error(text: str) -> str | None:
    """Why `text` is not a comma-separated list of at least one level (the first bad rung's
    `parse_level` message), or None when it is one (actuator.compression_ladder)."""
    rungs = [x.strip() for x in text.split(",") if x.strip()]
    if not rungs:
        return "no level given"
    for rung in rungs:
        error = level_error(rung)
        if error is not None:
            return f"rung {rung!r}: {error}"
    return None


def is_ladder(text: str) -> bool:
    """A comma-separated list of at least one level (actuator.compression_ladder)."""
    return ladder_error(text) is None


GRAMMAR = "none, bf16, int8[:B], lowrank[-bf16]:R[:W[:int8|:exact]], topk:F"
# With these `load_config` checks the levels: a bad `TRAINSPEC_KERNELS_COMPRESSION` is a
# warning and the lower-precedence value, like any other bad variable, instead of an error
# from `ts.wrap` that takes the job down. (`trainspec.config` imports nothing of trainspec.)
# The message names the setting, the value, the grammar and `parse_level`'s own reason:
# "kernels.compression: 'int8:65537' must be a compression level (...): compression level
# 'int8': block size must be at most 65536, got 65537".
LEVEL_RULES: dict[str, Rule] = {
    "kernels.compression": Rule(
        f"must be a compression level ({GRAMMAR})", is_level, why=level_error
    ),
    "actuator.compression_ladder": Rule(
        f"must be levels separated by commas ({GRAMMAR})", is_ladder, why=ladder_error
    ),
}
