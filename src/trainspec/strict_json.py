"""JSON without NaN or infinity, which the format does not have: strict parsers (jq,
browsers, `json.loads(..., parse_constant=...)` as `trainspec validate` reads event evidence)
refuse Python's bare `NaN`. Such a double is written as the string "NaN", "Infinity" or
"-Infinity", as protobuf's JSON mapping (and so OTLP/JSON) writes it; `float()` and
JavaScript's `Number()` read them back. Not null, which means a missing value: a loss that
went NaN is not a missing loss."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def json_float(value: float) -> float | str:
    """`value`, or its string spelling when it is not finite."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def finite_only(value: Any) -> Any:
    """`value` with every non-finite float in it, in lists, tuples and dicts (keys too) at
    any depth, spelled as a string (`json_float`); everything else as it was."""
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, (list, tuple)):
        return [finite_only(v) for v in value]
    if isinstance(value, dict):  # a float key too: `allow_nan=False` refuses a NaN key
        return {
            json_float(k) if isinstance(k, float) else k: finite_only(v) for k, v in value.items()
        }
    return value


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, **kwargs: Any) -> str:
    """`json.dumps` that writes strict JSON: non-finite floats as strings (`finite_only`),
    also those a `default` turns an object into."""

    def strict_default(obj: Any) -> Any:
        if default is None:
            raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
        return finite_only(default(obj))

    return json.dumps(finite_only(value), default=strict_default, allow_nan=False, **kwargs)
