"""Reading a saved controller part back: typed values, where a missing key keeps the default.

A part's `load_state_dict` reads each of its keys through these, so a checkpoint written before
a key existed still loads (the part keeps what it has), and a value of the wrong type is a
`StateError` naming the key rather than a comparison error windows later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class StateError(ValueError):
    """A saved controller state whose shape or values do not fit (names what was wrong)."""


def _mapping(state: Any) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise StateError(f"expected an object, got {type(state).__name__}")
    return state


def read_bool(state: Any, key: str, current: bool) -> bool:
    value = _mapping(state).get(key, current)
    if not isinstance(value, bool):
        raise StateError(f"{key} must be true or false, got {value!r}")
    return value


def read_count(state: Any, key: str, current: int) -> int:
    """A whole number >= 0 (not a bool, not a float)."""
    value = _mapping(state).get(key, current)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateError(f"{key} must be a whole number >= 0, got {value!r}")
    return value


def read_float(state: Any, key: str, current: float) -> float:
    """A number; null reads as NaN ("none yet": JSON has no NaN)."""
    value = _mapping(state).get(key, current)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateError(f"{key} must be a number or null, got {value!r}"[:200])
    try:
        return float(value)
    except OverflowError:
        raise StateError(f"{key} must be a number a float can hold") from None


def finite_or_none(value: float) -> float | None:
    """How a float is saved: NaN and infinities as null, which `read_float` reads as NaN."""
    return value if math.isfinite(value) else None
