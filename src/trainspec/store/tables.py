"""The four tables of a run and their Arrow schemas."""

from __future__ import annotations

import pyarrow as pa

SAMPLES = pa.schema(
    [
        ("ts", pa.float64()),  # unix seconds
        ("rank", pa.int32()),
        ("metric", pa.string()),  # catalogue (OTel-style) name
        ("value", pa.float64()),
        ("attrs", pa.string()),  # JSON object of point attributes, "{}" when none
    ]
)

STEPS = pa.schema(
    [
        ("ts", pa.float64()),  # unix seconds at step end
        ("rank", pa.int32()),
        ("step", pa.int64()),
        ("duration_s", pa.float64()),
        ("data_wait_s", pa.float64()),
        ("forward_s", pa.float64()),
        ("backward_s", pa.float64()),
        ("optimizer_s", pa.float64()),
        ("comm_exposed_s", pa.float64()),
        ("allreduce_s", pa.float64()),
        ("samples", pa.int64()),
        ("tokens", pa.int64()),
        ("throughput", pa.float64()),
        ("loss", pa.float64()),
        ("mfu", pa.float64()),
        ("grad_norm", pa.float64()),
        ("grad_variance", pa.float64()),
        ("grad_noise_scale", pa.float64()),
        ("comm_bytes", pa.int64()),
        ("compression", pa.string()),
    ]
)

EVENTS = pa.schema(
    [
        ("ts", pa.float64()),
        ("rank", pa.int32()),
        ("step", pa.int64()),
        ("kind", pa.string()),  # checkpoint | fault | anomaly | action
        ("name", pa.string()),  # e.g. straggler, rebalance, periodic
        ("severity", pa.string()),  # info | warning | error | critical
        ("reason", pa.string()),  # words a person reads
        ("evidence", pa.string()),  # JSON object
        ("before", pa.string()),  # JSON, actions only
        ("after", pa.string()),  # JSON, actions only
    ]
)

RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("rank", pa.int32()),
        ("local_rank", pa.int32()),
        ("world_size", pa.int32()),
        ("host", pa.string()),
        ("started_at", pa.float64()),
        ("device", pa.string()),  # cpu | cuda
        ("gpus", pa.string()),  # JSON list of {index, uuid, name}
        ("config", pa.string()),  # JSON
        ("versions", pa.string()),  # JSON
    ]
)

TABLES: dict[str, pa.Schema] = {"samples": SAMPLES, "steps": STEPS, "events": EVENTS, "runs": RUNS}
EVENT_KINDS = ("checkpoint", "fault", "anomaly", "action")


def empty_table(table: str) -> pa.Table:
    return TABLES[table].empty_table()


def to_arrow(table: str, rows: dict[str, list]) -> pa.Table:
    """Column lists -> an Arrow table of the table's schema; missing columns become nulls."""
    schema = TABLES[table]
    n = max((len(v) for v in rows.values()), default=0)
    arrays = [pa.array(rows.get(f.name, [None] * n), type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)
