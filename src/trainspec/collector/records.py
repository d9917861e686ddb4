"""The records that flow from the training job to the sinks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa

from trainspec import strict_json
from trainspec.store.tables import to_arrow

# (catalogue metric name, value, attributes as JSON) read now, or with a 4th element: the
# unix time it was measured at, when that differs from the moment it is handed over.
Reading = tuple[str, float, str] | tuple[str, float, str, float]


def attrs_json(attrs: dict[str, Any] | None = None) -> str:
    """Attributes encoded once, sorted, so equal attribute sets compare equal as strings."""
    return json.dumps(attrs or {}, sort_keys=True, separators=(",", ":"))


@dataclass
class StepRecord:
    """One rank's view of one optimizer step (a row of the `steps` table)."""

    ts: float
    rank: int
    step: int
    duration_s: float
    data_wait_s: float = 0.0
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    comm_exposed_s: float | None = None
    allreduce_s: float | None = None
    samples: int = 0
    tokens: int | None = None
    throughput: float | None = None
    loss: float | None = None
    mfu: float | None = None
    grad_norm: float | None = None
    grad_variance: float | None = None
    grad_noise_scale: float | None = None
    comm_bytes: int | None = None
    compression: str | None = None


STEP_FIELDS = [f.name for f in fields(StepRecord)]


@dataclass
class EventRecord:
    """An anomaly, action, checkpoint or fault (a row of the `events` table)."""

    ts: float
    rank: int
    step: int
    kind: str
    name: str
    reason: str
    severity: str = "info"
    evidence: dict[str, Any] = field(default_factory=dict)
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("evidence", "before", "after"):
            # strict JSON: a NaN in evidence (a detector's reading) is the string "NaN"
            d[key] = (
                None if d[key] is None else strict_json.dumps(d[key], sort_keys=True, default=str)
            )
        return d


def rows_to_columns(rows: list[dict[str, Any]], names: list[str]) -> dict[str, list]:
    return {n: [r.get(n) for r in rows] for n in names}


@dataclass
class Batch:
    """What one flush hands to every sink: raw samples, step rows and events since the last."""

    samples: pa.Table
    steps: list[StepRecord]
    events: list[EventRecord]

    def steps_table(self) -> pa.Table:
        # Read field by field: `asdict` copies every record recursively, about 100 us per
        # row on the flush thread, whose Python holds the GIL the training thread needs.
        return to_arrow("steps", {n: [getattr(s, n) for s in self.steps] for n in STEP_FIELDS})

    def events_table(self) -> pa.Table:
        rows = [e.row() for e in self.events]
        return to_arrow("events", rows_to_columns(rows, list(rows[0]) if rows else []))

    def is_empty(self) -> bool:
        return self.samples.num_rows == 0 and not self.steps and not self.events
