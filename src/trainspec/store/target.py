"""Read a trainspec run (a run directory or its run.duckdb) into validator statistics.

The statistics are computed in DuckDB (window functions for gaps and drops), so a run of
millions of 50 ms samples is judged without pulling its rows into Python. It lives in
the store (which may import the schema), so `trainspec.schema` imports nothing of trainspec.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainspec.schema.catalogue import Catalogue
from trainspec.schema.targets.model import (
    EventRecord,
    RankInfo,
    SeriesStats,
    TargetData,
    TargetError,
    UnknownName,
    check_world_size,
    rank_outside_world,
)
from trainspec.schema.targets.resources import count_fault
from trainspec.store.step_numbering import read_step_numbering

# Cadence is judged over each rank's training loop, from its first step's start to its last
# step's end (the whole series where a rank has no steps): before the loop a script builds its
# model, data and process groups, and one call holding the interpreter lock for 200 ms there
# (seen in a 10-step demo) is the script's, not a sampler falling behind; in a short run a
# couple of such gaps would set the p95 of every series. A gap counts when it overlaps the loop.
# A rank restarted (torchrun --max-restarts) is a new process with a runs row of its own: each
# process has its own loop span and its own series (a point's gap and change are from the
# point before it in the same process: a gap across a process's start is the restart, the
# rank dead and then importing, not a late sampler, and a counter that falls there was reset
# with its process, as Prometheus reads a counter reset). Before, a resumed 40-step job failed
# cadence on every 50 ms series (p95 gap 0.086 s, max 6.5 s) and every 1 s one.
# Coverage is judged against the same span: each series must start by the first step of each
# process's loop and last until its last step ends (a process with no steps: the span of all
# its samples). A rank's own loop, not the job's: a rank that ran out of data and joined, or
# joined a resumed job late, covers its own steps. The samplers run from `init` to close, and
# take one more reading as they close, so a healthy series overhangs both edges.
SPAN = "its process's training loop (first step's start to last step's end)"
SAMPLE_STATS = """
WITH attempts AS (  -- each process of a rank, from its start (the first from the beginning)
  SELECT rank, CASE WHEN row_number() OVER (PARTITION BY rank ORDER BY started_at) = 1
                    THEN -1e308 ELSE started_at END AS a0
  FROM (SELECT DISTINCT rank, started_at FROM runs
        WHERE rank IS NOT NULL AND isfinite(started_at))
), placed AS (
  SELECT p.*, a.a0 AS attempt FROM samples p ASOF LEFT JOIN attempts a
         ON p.rank = a.rank AND p.ts >= a.a0
), loop_span AS (
  SELECT st.rank, a.a0 AS attempt, min(st.ts - coalesce(st.duration_s, 0)) AS t0,
         max(st.ts) AS t1
  FROM steps st ASOF LEFT JOIN attempts a ON st.rank = a.rank AND st.ts >= a.a0
  GROUP BY ALL
), s AS (  -- a point's gap and change from the one before it in the same process
  SELECT metric, rank, attrs, ts, value, attempt,
         lag(ts) OVER w AS prev,
         lag(value) OVER w AS prev_value,
         ts - lag(ts) OVER w AS gap,
         value - lag(value) OVER w AS delta
  FROM placed
  WINDOW w AS (PARTITION BY metric, rank, attrs, attempt ORDER BY ts, value)
), judged AS (
  SELECT s.*, l.rank IS NULL OR (s.ts > l.t0 AND s.prev < l.t1) AS in_loop
  FROM s LEFT JOIN loop_span l ON s.rank IS NOT DISTINCT FROM l.rank
       AND s.attempt IS NOT DISTINCT FROM l.attempt
), span AS (  -- what a process's series must cover: its loop, or its samples' span
  SELECT rank, attempt, t0, t1 FROM loop_span
  UNION ALL
  SELECT rank, attempt, min(ts), max(ts) FROM placed p WHERE isfinite(ts) AND NOT EXISTS (
      SELECT 1 FROM loop_span l WHERE l.rank IS NOT DISTINCT FROM p.rank
                                  AND l.attempt IS NOT DISTINCT FROM p.attempt)
  GROUP BY rank, attempt
), edges AS (  -- the gaps from a process's start to a series' first point, and last to end
  SELECT e.metric, e.rank, e.attrs, max(first - sp.t0) AS head, max(sp.t1 - last) AS tail
  FROM (SELECT metric, rank, attrs, attempt, min(ts) AS first, max(ts) AS last
        FROM placed WHERE isfinite(ts) GROUP BY ALL) e
  JOIN span sp ON e.rank IS NOT DISTINCT FROM sp.rank AND e.attempt IS NOT DISTINCT FROM sp.attempt
  GROUP BY ALL
), stats AS (
  SELECT metric, rank, attrs, count(*) AS n,
       count(*) FILTER (WHERE value IS NULL) AS nulls,
       count(*) FILTER (WHERE value IS NOT NULL AND NOT isfinite(value)) AS nonfinite,
       min(value) FILTER (WHERE isfinite(value)) AS lo,
       max(value) FILTER (WHERE isfinite(value)) AS hi,
       quantile_cont(gap, 0.95) FILTER (WHERE in_loop) AS p95,
       max(gap) FILTER (WHERE in_loop) AS max_gap,
       count(*) FILTER (WHERE delta < 0) AS drops, min(delta) FILTER (WHERE delta < 0) AS drop,
       count(*) FILTER (WHERE gap = 0 AND value IS DISTINCT FROM prev_value) AS conflicts,
       count(*) FILTER (WHERE ts IS NULL OR NOT isfinite(ts)) AS untimed
  FROM judged GROUP BY metric, rank, attrs
)
SELECT st.metric, st.rank, st.attrs, n, nulls, nonfinite, lo, hi, p95, max_gap, drops, drop,
       conflicts, untimed, e.head, e.tail
FROM stats st LEFT JOIN edges e ON st.metric = e.metric AND st.rank IS NOT DISTINCT FROM e.rank
     AND st.attrs IS NOT DISTINCT FROM e.attrs
ORDER BY st.metric, st.rank, st.attrs
"""


def _step_stats_sql(columns: list[str], excused_by: list[str], needs: list[int]) -> str:
    """Per rank: row count, rows with no finite time, then per column its empty rows (less those on a step that an
    event named in `excused_by` marks on that rank, or on which fewer ranks than `needs`
    trained on samples), non-finite values, finite min and max."""
    names = sorted({e for e in excused_by if e})
    marks = ", ".join(f"bool_or(name = '{n}') AS \"_marked_{n}\"" for n in names)
    source = "steps"
    if names:
        listed = ", ".join(f"'{n}'" for n in names)
        source = (
            f"steps LEFT JOIN (SELECT rank AS e_rank, step AS e_step, {marks} FROM events "
            f"WHERE name IN ({listed}) GROUP BY ALL) e "
            "ON e.e_rank IS NOT DISTINCT FROM steps.rank AND e.e_step = steps.step"
        )
    if any(needs):  # per step, the ranks that trained on samples (a count not given counts)
        source += (
            " LEFT JOIN (SELECT step AS t_step, count(DISTINCT rank) FILTER (WHERE samples IS"
            " NULL OR samples > 0) AS _trained FROM steps GROUP BY step) t"
            " ON t.t_step = steps.step"
        )
    parts = ["rank", "count(*)", "count(*) FILTER (WHERE ts IS NULL OR NOT isfinite(ts))"]
    for col, excuse, need in zip(columns, excused_by, needs, strict=True):
        v = f'CAST("{col}" AS DOUBLE)'
        empty = f'"{col}" IS NULL'
        if excuse:
            empty += f' AND NOT coalesce("_marked_{excuse}", false)'
        if need:
            empty += f" AND coalesce(_trained, 0) >= {int(need)}"
        parts += [
            f"count(*) FILTER (WHERE {empty})",
            f"count(*) FILTER (WHERE {v} IS NOT NULL AND NOT isfinite({v}))",
            f"min({v}) FILTER (WHERE isfinite({v}))",
            f"max({v}) FILTER (WHERE isfinite({v}))",
        ]
    return f"SELECT {', '.join(parts)} FROM {source} GROUP BY rank ORDER BY rank"


def _gpus(raw: str | None) -> bool:
    try:
        gpus = json.loads(raw or "[]")
    except ValueError:
        return False
    return isinstance(gpus, list) and len(gpus) > 0


def _process_group(raw: str | None) -> bool:
    """Whether the rank had a process group, as its runs row's config says (`process_group`,
    written since 2026-11-27); a row that does not say did (the rule before)."""
    try:
        config = json.loads(raw or "{}")
    except ValueError:
        return True
    return not (isinstance(config, dict) and config.get("process_group") is False)


def _read_ranks(con, data: TargetData) -> bool:
    """Ranks and world size from the runs table; whether any row declared a world size."""
    rows = con.execute(
        "SELECT rank, world_size, device, gpus, config FROM runs ORDER BY rank"
    ).fetchall()
    for rank, world_size, device, gpus, config in rows:
        data.ranks[rank] = RankInfo(
            gpu=_gpus(gpus), cuda=device == "cuda", communicates=_process_group(config)
        )
        data.world_size = max(data.world_size, world_size or 1)
    # Ranks the world size promises but no runs row describes are expected too: a rank
    # that never started is exactly what the validator must catch. Assume its peers' devices.
    check_world_size(data.world_size, data.source)
    for rank, world_size, *_ in rows:
        _check_runs_row(rank, world_size, data)
    highest = max((r for r, *_ in rows if r is not None), default=0)
    check_world_size(highest + 1, data.source, from_rank=True)
    if rows:
        like = next(iter(data.ranks.values()))
        for rank in range(data.world_size):
            data.ranks.setdefault(rank, like)
    return any(world_size is not None for _, world_size, *_ in rows)


def _check_runs_row(rank: int | None, world_size: int | None, data: TargetData) -> None:
    """A runs row's rank counts from 0 and its world size from 1, the rank below the world
    size the row itself declares (a rank of 3 in a world of 2 was judged against the largest
    world size any row declared). Rows may declare different world sizes: a job resumed
    under its run id with more or fewer ranks writes rows of its new size."""
    where = f"runs row of rank {'?' if rank is None else rank}"
    if rank is None:
        data.resource_invalid.append((None, "a runs row has no rank"))
    elif fault := count_fault("rank", rank, 0):
        data.resource_invalid.append((None, f"{where}: {fault}"))
    if world_size is not None and (fault := count_fault("world_size", world_size, 1)):
        data.resource_invalid.append((rank, f"{where}: {fault}"))
    # At or above the largest world size, `_check_rank_bounds` says so.
    elif rank is not None and world_size is not None and world_size <= rank < data.world_size:
        data.resource_invalid.append(
            (rank, f"{where}: {rank_outside_world(rank, world_size)} (its own row's)")
        )


def _check_rank_bounds(data: TargetData, ranks: set, declared: bool) -> None:
    """A rank with rows (a runs row, samples or steps) at or above the world size its runs
    rows declare: rows of rank 5 in a run of 2 were judged compliant, warned only for
    lacking a runs row."""
    if not declared:
        return  # no runs row says how large the world is
    for rank in sorted(r for r in ranks if r is not None and r >= data.world_size):
        data.resource_invalid.append((rank, rank_outside_world(rank, data.world_size)))


def _read_samples(con, catalogue: Catalogue, data: TargetData) -> None:
    for row in con.execute(SAMPLE_STATS).fetchall():
        metric, rank, attrs_json, n = row[0], row[1], row[2], row[3]
        if metric not in catalogue.metrics:
            data.unknown.append(UnknownName(metric, rank, f"{n} rows in samples"))
            continue
        stats = SeriesStats(metric, rank, {}, count=n)
        try:
            attrs = json.loads(attrs_json or "{}")
            if not isinstance(attrs, dict):
                raise ValueError("not a JSON object")
            stats.attrs = attrs
        except ValueError as exc:
            stats.attrs_error = f"attrs {attrs_json!r}: {exc}"
        stats.nulls, stats.nonfinite, stats.minimum, stats.maximum = row[4:8]
        stats.p95_gap_s, stats.max_gap_s = row[8], row[9]
        stats.cumulative = catalogue[metric].instrument == "counter"
        if stats.cumulative:
            stats.decreases, stats.largest_drop = row[10], row[11]
        stats.conflicts, stats.untimed = row[12], row[13]
        stats.head_gap_s, stats.tail_gap_s = row[14], row[15]
        data.series.append(stats)


def _read_steps(con, catalogue: Catalogue, data: TargetData) -> None:
    metrics = catalogue.in_table("steps")
    columns = [m.store_column or "" for m in metrics]
    excused_by = [m.absent_with_event for m in metrics]
    needs = [m.needs_ranks_with_samples for m in metrics]
    for row in con.execute(_step_stats_sql(columns, excused_by, needs)).fetchall():
        rank, n, untimed = row[0], row[1], row[2]
        for i, metric in enumerate(metrics):
            nulls, nonfinite, lo, hi = row[3 + 4 * i : 7 + 4 * i]
            data.series.append(
                SeriesStats(
                    metric.name,
                    rank,
                    {},
                    count=n,
                    nulls=nulls,
                    nonfinite=nonfinite,
                    minimum=lo,
                    maximum=hi,
                    untimed=untimed,
                )
            )


def _read_events(con, data: TargetData) -> None:
    sql = "SELECT rank, kind, name, reason, evidence, before, after FROM events ORDER BY rank, ts"
    data.events = [EventRecord(*row) for row in con.execute(sql).fetchall()]


def _read_journals(target: Path, data: TargetData) -> None:
    """Rows a killed process journaled and never flushed are not in the views until stored."""
    from trainspec.store.journal import unsalvaged_writers

    if not target.is_dir():
        return
    writers = unsalvaged_writers(target)
    if writers:
        data.warnings.append(
            f"{', '.join(writers)}: rows journaled by a process that ended before flushing "
            f"them are not read; `trainspec compact {target}` stores them"
        )


def read_run(target: str | Path, catalogue: Catalogue) -> TargetData:
    """Statistics of a run directory or run.duckdb; raises TargetError if unreadable."""
    import duckdb

    from trainspec.store.errors import StoreError, first_line
    from trainspec.store.reader import open_run, skipped_segments

    try:
        con = open_run(target)
    except StoreError as exc:
        raise TargetError(str(exc)) from exc
    data = TargetData(source=str(target), kind="run", span=SPAN)
    declared = False
    try:
        declared = _read_ranks(con, data)
        _read_samples(con, catalogue, data)
        _read_steps(con, catalogue, data)
        read_step_numbering(con, data)
        _read_events(con, data)
        # Listed after reading: a file damaged behind its footer is found (and left out)
        # only when a read fails on it.
        for path, reason in skipped_segments(con):
            data.warnings.append(f"segment skipped as unreadable: {path}: {reason}")
        _read_journals(Path(target), data)
    except duckdb.Error as exc:
        raise TargetError(f"{target}: cannot read run: {first_line(exc)}") from exc
    finally:
        con.close()
    seen = {s.rank for s in data.series} | {u.rank for u in data.unknown}
    _check_rank_bounds(data, seen | set(data.ranks), declared)
    for rank in sorted((r for r in seen if r not in data.ranks), key=lambda r: (r is None, r or 0)):
        data.ranks[rank] = RankInfo(gpu=False, cuda=False)
        data.warnings.append(f"rank {rank} has data but no row in the runs table")
    return data
