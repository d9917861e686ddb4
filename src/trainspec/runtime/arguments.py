"""Checks of what a script passes to the session, made at the call that passed it.

A value that is only converted later (a tensor as `samples`, a list as an event's evidence)
failed on the flush thread instead, and took every record of that flush with it; a string
failed at the step's end, after its body ran, replacing the script's own exception.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

from trainspec.store.tables import EVENT_KINDS

SEVERITIES = (
    "info",
    "warning",
    "error",
    "critical",
)  # the collector and actuator use the first three


def brief(value: Any) -> str:
    """`repr(value)` on one line and short: an array's repr ran to several lines of the
    message."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def whole_number(name: str, value: Any) -> int:
    """An int, or anything with `__index__` (a NumPy integer, an integer 0-d tensor), as an
    int; TypeError naming `name` for a bool, a float, a string."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a whole number, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a whole number, not {type(value).__name__} {brief(value)}"
        ) from None


def count(name: str, value: Any) -> int:
    """A whole number >= 0, as an int."""
    number = whole_number(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, not {number}")
    if number >= MAX_COUNT:  # stored as a 64-bit integer: it failed the flush's whole table
        raise ValueError(f"{name} must be below 2**63, not {brief(number)}")
    return number


MAX_COUNT = 1 << 63


def optional_count(name: str, value: Any) -> int | None:
    return None if value is None else count(name, value)


def non_negative_number(name: str, value: Any) -> float:
    """A finite real number >= 0, as a float."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} {brief(value)}")
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # a NumPy or 0-d tensor scalar
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a number, not {type(value).__name__}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, not {brief(value)}")
    return float(value)


def positive_seconds(name: str, value: Any) -> float:
    """A finite number of seconds > 0, as a float."""
    seconds = non_negative_number(name, value)
    if seconds <= 0:
        raise ValueError(f"{name} must be > 0 seconds, not {value!r}")
    return seconds


def event_fields(kind: Any, name: Any, reason: Any, severity: Any, objects: dict[str, Any]) -> None:
    """An event's kind and severity among the catalogue's, its words text, and each of
    `objects` (evidence, before, after) None or a dict the store can write as a JSON object
    (string keys; other values are written as their text)."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind {kind!r}: must be one of {', '.join(EVENT_KINDS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"event severity {severity!r}: must be one of {', '.join(SEVERITIES)}")
    for label, text in (("name", name), ("reason", reason)):
        if not isinstance(text, str) or not text:
            raise TypeError(f"event {label} must be a non-empty string, not {text!r}")
    for label, obj in objects.items():
        if obj is None:
            continue
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise TypeError(f"event {label} must be a dict with string keys, not {obj!r}")
        try:
            json.dumps(obj, sort_keys=True, default=str)  # as the store writes it
        except (TypeError, ValueError) as exc:
            raise TypeError(f"event {label} is not JSON: {exc}") from None
