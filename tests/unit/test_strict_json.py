"""Event evidence and `query --json` are strict JSON: a non-finite double is a string."""

from __future__ import annotations

import json
import math

import pytest

from trainspec import strict_json
from trainspec.collector.records import EventRecord


def _strict_loads(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_event_evidence_with_a_nan_reading_is_strict_json() -> None:
    event = EventRecord(
        ts=1.0,
        rank=0,
        step=3,
        kind="anomaly",
        name="memory_pressure",
        reason="r",
        evidence={"pressure": [0.5, math.nan], "peak": math.inf, "n": 2},
        before={"low": -math.inf},
    )
    row = event.row()
    assert _strict_loads(row["evidence"]) == {
        "n": 2,
        "peak": "Infinity",
        "pressure": [0.5, "NaN"],
    }
    assert _strict_loads(row["before"]) == {"low": "-Infinity"}
    assert row["after"] is None


def test_a_default_that_yields_a_nan_is_spelled_too() -> None:
    class Reading:
        pass

    text = strict_json.dumps({"r": Reading()}, default=lambda _: {"v": math.nan})
    assert _strict_loads(text) == {"r": {"v": "NaN"}}


def test_an_object_with_no_default_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="Reading"):

        class Reading:
            pass

        strict_json.dumps([Reading()])


def test_finite_values_and_tuples_pass_unchanged() -> None:
    assert strict_json.finite_only((1.5, {"a": [2, None, "NaN"]})) == [1.5, {"a": [2, None, "NaN"]}]


def test_a_non_finite_key_is_spelled_not_refused() -> None:
    assert json.loads(strict_json.dumps({math.nan: 1, 2.5: 2})) == {"NaN": 1, "2.5": 2}
