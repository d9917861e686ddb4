"""The collector's flush: one Parquet segment per table, written by pyarrow's Parquet writer
(`SegmentWriter.write`, since 2026-11-25) against a DuckDB `COPY` of the same rows (how it
was written before, and how merges still are), alternated A B A B.

A batch is what one rank flushes every 2 s at 50 ms sampling: 40 ticks of 30 series for
`samples`, 48 step rows for `steps`. Reported per write: the calling thread's CPU (the flush
thread shares the cores with training), wall time, and the segment's bytes.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parser, print_table, quartiles, write_json  # noqa: E402
from trainspec.store.segments import SegmentWriter  # noqa: E402
from trainspec.store.tables import STEPS, to_arrow  # noqa: E402

TICKS, SERIES, STEPS_PER_FLUSH = 40, 30, 48


def samples_batch(rng: random.Random) -> pa.Table:
    names = [f"trainspec.bench.metric_{i}" for i in range(SERIES)]
    t0 = time.time()
    rows: dict[str, list] = {"ts": [], "rank": [], "metric": [], "value": [], "attrs": []}
    for tick in range(TICKS):
        for i, name in enumerate(names):
            rows["ts"].append(t0 + 0.05 * tick)
            rows["rank"].append(0)
            rows["metric"].append(name)
            rows["value"].append(rng.random())
            rows["attrs"].append('{"gpu.index":0}' if i % 3 else "{}")
    return to_arrow("samples", rows)


def steps_batch(rng: random.Random) -> pa.Table:
    rows: dict[str, list] = {}
    for field in STEPS:
        if pa.types.is_floating(field.type):
            rows[field.name] = [rng.random() for _ in range(STEPS_PER_FLUSH)]
        elif pa.types.is_integer(field.type):
            rows[field.name] = list(range(STEPS_PER_FLUSH))
        else:
            rows[field.name] = ["none"] * STEPS_PER_FLUSH
    return to_arrow("steps", rows)


def duckdb_copy(table: pa.Table, dest: Path, con: duckdb.DuckDBPyConnection) -> None:
    """The segment as DuckDB writes it (the flush before 2026-11-25; merges now)."""
    con.register("_batch", table)
    try:
        con.execute(f"COPY (SELECT * FROM _batch) TO '{dest}' (FORMAT parquet, COMPRESSION zstd)")
    finally:
        con.unregister("_batch")


def timed(writes: int, write: Callable[[int], Path]) -> dict[str, float]:
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    paths = [write(i) for i in range(writes)]
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    return {
        "cpu_ms": 1e3 * cpu / writes,
        "wall_ms": 1e3 * wall / writes,
        "bytes": sum(p.stat().st_size for p in paths) / writes,
    }


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rounds, writes = (2, 20) if args.quick else (4, 100)
    rng = random.Random(0)
    batches = {"samples": samples_batch(rng), "steps": steps_batch(rng)}
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        con = duckdb.connect(":memory:", config={"threads": 1})
        for table, batch in batches.items():
            writer = SegmentWriter(Path(tmp) / "pyarrow", table, "rank-0")
            copies = Path(tmp) / "duckdb" / table
            copies.mkdir(parents=True)
            ways: dict[str, Callable[[int], Path]] = {
                "pyarrow (now)": lambda i, w=writer, b=batch: w.write(b),
                "duckdb COPY (before)": lambda i, d=copies, b=batch: _copy(b, d, i, con),
            }
            results[table] = {name: [] for name in ways}
            for r in range(rounds):
                for name in ways if r % 2 == 0 else list(ways)[::-1]:
                    results[table][name].append(timed(writes, ways[name]))
        con.close()
    rows: list[dict[str, Any]] = []
    for table, by_way in results.items():
        base = by_way["duckdb COPY (before)"]
        for name, runs in by_way.items():
            ratios = [r["cpu_ms"] / b["cpu_ms"] for r, b in zip(runs, base)]
            q1, med, q3 = quartiles(ratios)
            rows.append({
                "table": table,
                "writer": name,
                "rows": batches[table].num_rows,
                "cpu ms/write": quartiles([r["cpu_ms"] for r in runs])[1],
                "wall ms/write": quartiles([r["wall_ms"] for r in runs])[1],
                "KB/segment": runs[0]["bytes"] / 1e3,
                "cpu vs duckdb (q1-q3)": f"{med:.3f} ({q1:.3f}-{q3:.3f})",
            })  # fmt: skip
    print_table(rows)
    write_json(args.json_path, {"rounds": rounds, "writes_per_round": writes, "rows": rows})
    return 0


def _copy(batch: pa.Table, where: Path, i: int, con: duckdb.DuckDBPyConnection) -> Path:
    dest = where / f"seg-{i:06d}.parquet"
    duckdb_copy(batch, dest, con)
    return dest


if __name__ == "__main__":
    raise SystemExit(main())
