"""The kernels' compression-level grammar as configuration rules (`load_config(extra_rules=)`).

`trainspec.config` may import nothing of trainspec, so it cannot parse a level itself; the
runtime, which may import both, hands these rules in. With them a bad
`TRAINSPEC_KERNELS_COMPRESSION` is a warning and the lower-precedence value, like any other
bad variable, instead of an error from `ts.wrap` that takes the job down.
"""

from __future__ import annotations

from trainspec.config import Rule  # config_rules.Rule, the one config surface
from trainspec.kernels.codecs import LevelError, parse_level


def is_level(text: str) -> bool:
    try:
        parse_level(text)
    except LevelError:
        return False
    return True


def is_ladder(text: str) -> bool:
    """A comma-separated list of at least one level (actuator.compression_ladder)."""
    rungs = [x.strip() for x in text.split(",") if x.strip()]
    return bool(rungs) and all(is_level(r) for r in rungs)


GRAMMAR = "none, bf16, int8[:B], lowrank[-bf16]:R[:W[:int8|:exact]], topk:F"
LEVEL_RULES: dict[str, Rule] = {
    "kernels.compression": Rule(f"must be a compression level ({GRAMMAR})", is_level),
    "actuator.compression_ladder": Rule(
        f"must be levels separated by commas ({GRAMMAR})", is_ladder
    ),
}
