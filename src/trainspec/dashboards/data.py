"""What each dashboard view shows, loaded with DuckDB and downsampled in SQL.

Every loader takes a connection from `trainspec.store.open` (views over the run's Parquet
segments; a writer's files are never opened for writing) and returns pandas frames already
reduced to at most ~`points` buckets per series, so a run of millions of samples costs one
aggregate scan per chart rather than a million points in the browser. The Streamlit app, the
static report and `bench/dashboard.py` call the same loaders.

Times are seconds since the run's first record (`t`), steps are optimizer steps (`step`).
Every aggregate skips NaN and +-inf (`sql.finite`): one bad value no longer blanks a chart.

Beyond `LINE_RANKS` ranks the per-rank charts would draw hundreds of indistinguishable lines:
there the overview loads, per bucket, the spread across ranks (`sql.spread`: median, p10,
p90, min, max) and the per-rank lines and phase bars of the `SLOWEST_RANKS` slowest ranks
only, so what reaches the browser or the report is O(buckets), whatever the rank count.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from trainspec.dashboards.phases import load_phases
from trainspec.dashboards.runs import RunSummary, load_summary
from trainspec.dashboards.sql import COMPUTE_SQL, finite, one_row, spread
from trainspec.dashboards.stragglers import load_stragglers, slowest_ranks

DEFAULT_POINTS = 600  # per series: more than a chart's width in pixels buys nothing
HEATMAP_BINS = 120
HEATMAP_ROWS = 32  # beyond this many ranks the heatmap shows groups of consecutive ranks
UTILIZATION_METRICS = ("trainspec.gpu.utilization", "trainspec.process.cpu.utilization")
MEMORY_METRIC = "trainspec.memory.pressure"
LATENCY_METRIC = "trainspec.comm.probe.latency"
# Up to this many ranks every rank is its own line and phases bar: one 8-GPU node, fewer hues
# than the 10 of Vega's and matplotlib's categorical palettes, and a legend that fits beside
# the chart (the report's legend gave up past 8). Beyond, lines merge into an unreadable mass
# and the charts show the spread across ranks instead.
LINE_RANKS = 8
SPREAD_COLUMNS = ("n_ranks", "median", "p10", "p90", "min", "max")  # `sql.spread`'s columns


@dataclass
class OverviewData:
    summary: RunSummary
    step_time: pd.DataFrame  # step, rank, duration_s, compute_s, comm_exposed_s, data_wait_s
    phases: pd.DataFrame  # bar, rank, phase, seconds (mean per step); rank is NA on "median"
    series: pd.DataFrame  # metric, rank, t, value (bucket mean), peak (bucket max)
    gradients: pd.DataFrame  # step, grad_variance, grad_noise_scale, grad_norm, loss
    heatmap: pd.DataFrame  # rank, rank_end, ranks, step, step_end, compute_s, slowest_rank
    stragglers: pd.DataFrame  # rank, compute_s (median), ratio (to the median rank), slowest first
    # Beyond LINE_RANKS ranks, step_time, series and phases hold the `slowest` ranks only (and
    # a "median" phases bar), and these hold each bucket's SPREAD_COLUMNS over every rank:
    step_spread: pd.DataFrame  # step, SPREAD_COLUMNS of duration_s; empty up to LINE_RANKS
    series_spread: pd.DataFrame  # metric, t, SPREAD_COLUMNS of value; empty up to LINE_RANKS
    slowest: list[int]  # ranks drawn alone beyond LINE_RANKS, slowest first; else empty

    def metric_frames(self) -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
        """(metric, its per-rank lines, its spread across ranks) per metric, in load order."""
        lines, spread = self.series, self.series_spread
        metrics = dict.fromkeys([*spread["metric"], *lines["metric"]])
        return [(m, lines[lines["metric"] == m], spread[spread["metric"] == m]) for m in metrics]


@dataclass
class ActionsData:
    timeline: pd.DataFrame  # step, duration_s (slowest rank, bucket mean)
    # step, t, kind, name, severity, reason, evidence, before, after, ranks, and
    # rolled_back_from: for an action a later attempt undid, the step it resumed from (NaN
    # where none did)
    events: pd.DataFrame


@dataclass
class HardwareData:
    gpus: list[dict]  # from the runs table: rank, host, index, uuid, name
    series: pd.DataFrame  # metric, gpu (label), gpu_key, host, rank, gpu_index, t, value, peak


@dataclass
class CompareData:
    a: RunSummary
    b: RunSummary
    stats: pd.DataFrame  # statistic, a, b, ratio (b / a); complete steps only (_run_stats)
    curves: pd.DataFrame  # run, step, duration_s, throughput; complete steps only
    partial: tuple[int, int] = (0, 0)  # steps of A, of B reported by only some ranks: left out


def _step_bucket(steps: int, points: int) -> int:
    return max(1, math.ceil(steps / max(points, 1)))


def _time_bucket(summary: RunSummary, points: int) -> float:
    return max(summary.span_s / max(points, 1), 0.05)  # never finer than the 50 ms samples


def _only_ranks(ranks: list[int] | None) -> tuple[str, str, dict[str, list[int]]]:
    """WHERE condition, ORDER BY key and parameters for the rows of `ranks` in their order
    (the slowest first), or of every rank in rank order when `ranks` is None."""
    if ranks is None:
        return "TRUE", "rank", {}
    return "list_contains($ranks, rank)", "list_position($ranks, rank)", {"ranks": list(ranks)}


def load_step_time(
    con: duckdb.DuckDBPyConnection, steps: int, points: int, *, ranks: list[int] | None = None
) -> pd.DataFrame:
    """Step-bucket means per rank, of every rank or only of `ranks` (in that order)."""
    where, order, params = _only_ranks(ranks)
    return con.execute(
        f"""
        SELECT * FROM (
            SELECT (step // $b) * $b AS step, rank,
                   {finite("avg", "duration_s")} AS duration_s,
                   {finite("avg", COMPUTE_SQL)} AS compute_s,
                   {finite("avg", "comm_exposed_s")} AS comm_exposed_s,
                   {finite("avg", "data_wait_s")} AS data_wait_s
            FROM steps WHERE {where} GROUP BY ALL)
        ORDER BY {order}, step
        """,
        {"b": _step_bucket(steps, points), **params},
    ).df()


def load_step_spread(con: duckdb.DuckDBPyConnection, steps: int, points: int) -> pd.DataFrame:
    """Per step bucket, how the ranks' mean step time spreads: step, SPREAD_COLUMNS."""
    return con.execute(
        f"""
        WITH per_rank AS (
            SELECT (step // $b) * $b AS step, rank, {finite("avg", "duration_s")} AS duration_s
            FROM steps GROUP BY ALL)
        SELECT step, {spread("duration_s")} FROM per_rank GROUP BY step ORDER BY step
        """,
        {"b": _step_bucket(steps, points)},
    ).df()


def load_series(
    con: duckdb.DuckDBPyConnection,
    metrics: list[str],
    summary: RunSummary,
    points: int,
    *,
    ranks: list[int] | None = None,
) -> pd.DataFrame:
    """Time-bucket mean and max per metric and rank, of every rank or only of `ranks`."""
    if summary.t0 is None or not metrics:
        return pd.DataFrame(columns=["metric", "rank", "t", "value", "peak"])
    where, order, params = _only_ranks(ranks)
    w = _time_bucket(summary, points)
    return con.execute(
        f"""
        SELECT * FROM (
            SELECT metric, rank, floor((ts - $t0) / $w) * $w AS t,
                   {finite("avg", "value")} AS value, {finite("max", "value")} AS peak
            FROM samples WHERE list_contains($metrics, metric) AND isfinite(ts) AND {where}
            GROUP BY ALL)
        ORDER BY metric, {order}, t
        """,
        {"t0": summary.t0, "w": w, "metrics": metrics, **params},
    ).df()


def load_series_spread(
    con: duckdb.DuckDBPyConnection, metrics: list[str], summary: RunSummary, points: int
) -> pd.DataFrame:
    """Per metric and time bucket, how the ranks' bucket means spread: metric, t, SPREAD_COLUMNS."""
    if summary.t0 is None or not metrics:
        return pd.DataFrame(columns=["metric", "t", *SPREAD_COLUMNS])
    return con.execute(
        f"""
        WITH per_rank AS (
            SELECT metric, rank, floor((ts - $t0) / $w) * $w AS t,
                   {finite("avg", "value")} AS value
            FROM samples WHERE list_contains($metrics, metric) AND isfinite(ts) GROUP BY ALL)
        SELECT metric, t, {spread("value")} FROM per_rank GROUP BY ALL ORDER BY metric, t
        """,
        {"t0": summary.t0, "w": _time_bucket(summary, points), "metrics": metrics},
    ).df()


def load_gradients(con: duckdb.DuckDBPyConnection, steps: int, points: int) -> pd.DataFrame:
    # Gradient statistics are global (one all-reduce): ranks agree, so the mean is the value.
    return con.execute(
        f"""
        SELECT (step // $b) * $b AS step, {finite("avg", "grad_variance")} AS grad_variance,
               {finite("avg", "grad_noise_scale")} AS grad_noise_scale,
               {finite("avg", "grad_norm")} AS grad_norm, {finite("avg", "loss")} AS loss
        FROM steps GROUP BY ALL ORDER BY step
        """,
        {"b": _step_bucket(steps, points)},
    ).df()


def _rank_group(ranks: int, rows: int) -> int:
    """Consecutive ranks per heatmap row: 1 up to `rows` ranks, else enough to fit `rows`."""
    return max(1, math.ceil(ranks / max(rows, 1)))


def load_heatmap(
    con: duckdb.DuckDBPyConnection, steps: int, bins: int, *, ranks: int, rows: int = HEATMAP_ROWS
) -> pd.DataFrame:
    """Compute time per rank (rank, rank_end, label `ranks`) and step bucket (step, step_end).

    `ranks` is the number of rank slots (highest rank + 1). Beyond `rows` of them, a row is a
    group of consecutive ranks (`0-31`) showing its slowest rank's bucket mean, named in
    `slowest_rank`: a group's mean would dilute one straggler among 32 to a 2% rise, its
    maximum keeps it a bright row. The browser gets at most `rows` x `bins` cells.
    """
    g = _rank_group(ranks, rows)
    return con.execute(
        f"""
        WITH per_rank AS (
            SELECT rank, (step // $b) * $b AS step, {finite("avg", COMPUTE_SQL)} AS compute_s
            FROM steps GROUP BY ALL),
        grouped AS (
            SELECT (CAST(rank AS BIGINT) // $g) * $g AS first_rank, step, max(compute_s) AS compute_s,
                   arg_max(rank, compute_s) AS slowest_rank
            FROM per_rank GROUP BY ALL),
        spans AS (SELECT *, least(first_rank + $g - 1, $last) AS last_rank FROM grouped)
        SELECT first_rank AS rank, last_rank AS rank_end,
               CASE WHEN last_rank = first_rank THEN CAST(first_rank AS VARCHAR)
                    ELSE first_rank || '-' || last_rank END AS ranks,
               step, step + $b AS step_end, compute_s, slowest_rank
        FROM spans ORDER BY rank, step
        """,
        {"b": _step_bucket(steps, bins), "g": g, "last": max(ranks - 1, 0)},
    ).df()


def utilization_metric(con: duckdb.DuckDBPyConnection) -> str:
    """GPU utilization where the run has it, else the process's CPU utilization."""
    (has_gpu,) = one_row(
        con.execute(
            "SELECT count(*) > 0 FROM (SELECT 1 FROM samples WHERE metric = $m LIMIT 1)",
            {"m": UTILIZATION_METRICS[0]},
        )
    )
    return UTILIZATION_METRICS[0] if has_gpu else UTILIZATION_METRICS[1]


def load_overview(con: duckdb.DuckDBPyConnection, points: int = DEFAULT_POINTS) -> OverviewData:
    """Every overview chart's data; beyond LINE_RANKS ranks, spreads and the slowest ranks."""
    summary = load_summary(con)
    metrics = [utilization_metric(con), MEMORY_METRIC, LATENCY_METRIC]
    stragglers = load_stragglers(con)
    many = len(summary.ranks) > LINE_RANKS
    only = slowest_ranks(stragglers) if many else None
    return OverviewData(
        summary=summary,
        step_time=load_step_time(con, summary.steps, points, ranks=only),
        phases=load_phases(con, slowest=only),
        series=load_series(con, metrics, summary, points, ranks=only),
        gradients=load_gradients(con, summary.steps, points),
        heatmap=load_heatmap(
            con, summary.steps, HEATMAP_BINS, ranks=max(summary.ranks, default=-1) + 1
        ),
        stragglers=stragglers,
        step_spread=(
            load_step_spread(con, summary.steps, points)
            if many
            else pd.DataFrame(columns=["step", *SPREAD_COLUMNS])
        ),
        series_spread=(
            load_series_spread(con, metrics, summary, points)
            if many
            else pd.DataFrame(columns=["metric", "t", *SPREAD_COLUMNS])
        ),
        slowest=only or [],
    )


def load_actions(con: duckdb.DuckDBPyConnection, points: int = DEFAULT_POINTS) -> ActionsData:
    summary = load_summary(con)
    timeline = con.execute(
        f"""
        WITH per_step AS (
            SELECT step, {finite("max", "duration_s")} AS duration_s FROM steps GROUP BY step)
        SELECT (step // $b) * $b AS step, avg(duration_s) AS duration_s
        FROM per_step GROUP BY ALL ORDER BY step
        """,
        {"b": _step_bucket(summary.steps, points)},
    ).df()
    # Every rank applies (and records) the same decision: show it once, with its ranks; an
    # attempt's action a restart undid (rolled_back_from) apart from the same one made again.
    events = con.execute(
        f"""
        WITH {ROLLED_BACK_SQL}
        SELECT step, min(ts) - $t0 AS t, kind, name, severity, reason, evidence, before, after,
               list(DISTINCT rank ORDER BY rank) AS ranks, rolled_back_from
        FROM marked GROUP BY step, kind, name, severity, reason, evidence, before, after,
                             rolled_back_from
        ORDER BY step, t
        """,
        {"t0": summary.t0 or 0.0},
    ).df()
    return ActionsData(timeline=timeline, events=events)


# An action a later attempt of the job rolled back: after it was recorded, a process of its
# rank resumed from a checkpoint of an earlier step (a `checkpoint` `loaded` or `resumed`
# event, evidence `step`), or was restarted by torchrun (`restart` > 0 in its runs row's
# config) and loaded no checkpoint: from step 0. An action at the checkpoint's own step is in
# that checkpoint (it is saved after the boundary's other actions) and stays. The store
# needs nothing new for it: a rank's attempts are told apart by the time of those rows.
ROLLED_BACK_SQL = """
loads AS (SELECT rank, ts, TRY_CAST(CASE WHEN json_valid(evidence)
                 THEN json_extract_string(evidence, '$.step') END AS BIGINT) AS from_step
          FROM events WHERE kind = 'checkpoint' AND name IN ('loaded', 'resumed')),
starts AS (SELECT rank, started_at,
                  lead(started_at) OVER (PARTITION BY rank ORDER BY started_at) AS until,
                  TRY_CAST(CASE WHEN json_valid(config)
                      THEN json_extract_string(config, '$.restart') END AS BIGINT) AS restart
           FROM runs WHERE rank IS NOT NULL AND isfinite(started_at)),
resumes AS (SELECT rank, ts, from_step FROM loads WHERE from_step IS NOT NULL
            UNION ALL
            SELECT s.rank, s.started_at, 0 FROM starts s WHERE s.restart > 0 AND NOT EXISTS (
                SELECT 1 FROM loads l WHERE l.rank = s.rank AND l.ts >= s.started_at
                                        AND (s.until IS NULL OR l.ts < s.until))),
marked AS (SELECT e.*, CASE WHEN e.kind = 'action' THEN (
               SELECT arg_min(p.from_step, p.ts) FROM resumes p
               WHERE p.ts > e.ts AND p.from_step < e.step
                 AND (e.rank IS NULL OR p.rank = e.rank)) END AS rolled_back_from
           FROM events e)"""


def event_text(value: object) -> str | None:
    """An event's `evidence`, `before` or `after` JSON, None where NULL: pandas reads a NULL
    text as NaN, which is truthy and prints as `nan`."""
    return value if isinstance(value, str) and value else None


def event_ranks(value: Iterable[Any]) -> list[int]:
    """An event's `ranks` list as plain ints (DuckDB hands back a numpy int32 array). A
    NULL rank, a job-level event's (the launcher's `job_failed`, `cli/job_exit.py`), is
    none of them: DuckDB hands it back masked, and `int()` of it raised, so the actions
    view failed on a run with one."""
    if isinstance(value, np.ma.MaskedArray):
        value = value.compressed()
    return [int(rank) for rank in value if rank is not None and not pd.isna(rank)]


# One physical GPU: its index on its host (on no host, as seen by the rank that sampled it);
# where one host name and index carry several NVML UUIDs (`hw.id`: two nodes of one name),
# its UUID. Not the UUID alone: a series without one (an injected fault, a test's rows)
# would be another line for the same GPU.
GPU_KEY_SQL = """
    CASE WHEN hw_id IS NOT NULL AND (metric, host, gpu_index) IN (SELECT * FROM ambiguous)
         THEN hw_id
         WHEN host IS NOT NULL THEN 'host ' || host || ' gpu ' || coalesce(gpu_index, '?')
         ELSE 'rank ' || rank || ' gpu ' || coalesce(gpu_index, '?') END
"""


def load_hardware(con: duckdb.DuckDBPyConnection, points: int = DEFAULT_POINTS) -> HardwareData:
    """Time-bucket mean and max per GPU series and physical GPU (`GPU_KEY_SQL`), labelled by
    `gpu_labels`: GPU 0 of two nodes are two lines, one GPU sampled by two ranks is one."""
    summary = load_summary(con)
    if summary.t0 is None:
        return HardwareData(gpus=summary.gpus, series=pd.DataFrame())
    series = con.execute(
        f"""
        WITH hosts AS (SELECT rank, any_value(nullif(host, '')) AS host FROM runs GROUP BY rank),
        gpu_samples AS (
            SELECT s.metric, s.ts, s.value, s.rank, h.host,
                   json_extract_string(s.attrs, '$."gpu.index"') AS gpu_index,
                   json_extract_string(s.attrs, '$."hw.id"') AS hw_id
            FROM samples s LEFT JOIN hosts h USING (rank)
            WHERE starts_with(s.metric, 'trainspec.gpu.') AND isfinite(s.ts)),
        ambiguous AS (
            SELECT metric, host, gpu_index FROM gpu_samples
            GROUP BY ALL HAVING count(DISTINCT hw_id) > 1),
        keyed AS (SELECT *, {GPU_KEY_SQL} AS gpu_key FROM gpu_samples)
        SELECT metric, gpu_key, any_value(host) AS host, min(rank) AS rank,
               coalesce(any_value(gpu_index), '?') AS gpu_index,
               floor((ts - $t0) / $w) * $w AS t,
               {finite("avg", "value")} AS value, {finite("max", "value")} AS peak
        FROM keyed GROUP BY metric, gpu_key, t ORDER BY metric, gpu_key, t
        """,
        {"t0": summary.t0, "w": _time_bucket(summary, points)},
    ).df()
    labels = {metric: gpu_labels(frame) for metric, frame in series.groupby("metric")}
    series.insert(1, "gpu", [labels[m][k] for m, k in zip(series["metric"], series["gpu_key"])])
    return HardwareData(gpus=summary.gpus, series=series)


def gpu_labels(series: pd.DataFrame) -> dict[str, str]:
    """A legend label per `gpu_key` of one chart's `series`: `GPU 3` on one host,
    `node-b GPU 3` across hosts (or `rank 5 GPU 3` without a host), with the key appended
    where two GPUs would still share a label (two hosts of the same name)."""
    first = series.drop_duplicates("gpu_key")
    several_hosts = first["host"].dropna().nunique() > 1
    labels: dict[str, str] = {}
    for row in first.itertuples():
        gpu = f"GPU {row.gpu_index}"
        if pd.isna(row.host):
            labels[row.gpu_key] = f"rank {row.rank} {gpu}"
        else:
            labels[row.gpu_key] = f"{row.host} {gpu}" if several_hosts else gpu
    counts = pd.Series(list(labels.values())).value_counts()
    return {
        key: f"{label} ({key})" if counts[label] > 1 else label for key, label in labels.items()
    }


# Compare counts a step only once every rank has reported it: a step some ranks have not
# flushed yet (a live run's last seconds) or never will (a rank that died) has a step time
# of the ranks that did (its slowest rank may be missing) and part of the samples, so it
# would bias the medians and throughput low. Such steps are left out of the statistics and
# curves, and counted (`CompareData.partial`). "Every rank" is every rank with a row in `steps`.
# A step a restarted job ran again (resumed from a checkpoint before it) counts its latest row
# per rank, the one the model kept: both attempts' samples summed had doubled its throughput.
COMPLETE_STEPS_SQL = f"""
    kept AS (
        SELECT * FROM steps
        QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY ts DESC) = 1),
    per_step AS (
        SELECT step, count(DISTINCT rank) AS n_ranks,
               {finite("max", "duration_s")} AS duration_s, sum(samples) AS samples,
               {finite("avg", COMPUTE_SQL)} AS compute_s,
               {finite("avg", "coalesce(comm_exposed_s, 0)")} AS exposed
        FROM kept GROUP BY step),
    complete AS (
        SELECT * FROM per_step
        WHERE n_ranks = (SELECT count(DISTINCT rank) FROM steps))
"""


def _run_stats(con: duckdb.DuckDBPyConnection) -> tuple[dict[str, float | None], int]:
    """The headline statistics over complete steps, and how many steps were partial."""
    row = one_row(
        con.execute(
            f"""
        WITH {COMPLETE_STEPS_SQL}
        SELECT count(*), median(duration_s), quantile_cont(duration_s, 0.95),
               median(samples / nullif(duration_s, 0)), median(compute_s),
               sum(exposed) FILTER (WHERE duration_s IS NOT NULL) / nullif(sum(duration_s), 0),
               (SELECT count(*) FROM per_step) - count(*)
        FROM complete
        """
        )
    )
    names = (
        "steps",
        "median step time (s)",
        "p95 step time (s)",
        "median throughput (samples/s)",
        "median compute per rank (s)",
        "exposed communication share",
    )
    return dict(zip(names, row[:-1])), int(row[-1])


def _curves(con: duckdb.DuckDBPyConnection, label: str, steps: int, points: int) -> pd.DataFrame:
    df = con.execute(
        f"""
        WITH {COMPLETE_STEPS_SQL}
        SELECT (step // $b) * $b AS step, avg(duration_s) AS duration_s,
               avg(samples / nullif(duration_s, 0)) AS throughput
        FROM complete GROUP BY ALL ORDER BY step
        """,
        {"b": _step_bucket(steps, points)},
    ).df()
    df.insert(0, "run", label)
    return df


def load_compare(
    con_a: duckdb.DuckDBPyConnection,
    con_b: duckdb.DuckDBPyConnection,
    points: int = DEFAULT_POINTS,
) -> CompareData:
    a, b = load_summary(con_a), load_summary(con_b)
    (sa, partial_a), (sb, partial_b) = _run_stats(con_a), _run_stats(con_b)
    rows = []
    for name in sa:
        va, vb = sa[name], sb[name]
        ratio = vb / va if va not in (None, 0) and vb is not None else None
        rows.append({"statistic": name, "a": va, "b": vb, "ratio": ratio})
    label_a = a.run_id or "A"
    label_b = b.run_id or "B"
    if label_b == label_a:  # a copied run keeps its id: still tell the two curves apart
        label_b = f"{label_b} (B)"
    curves = pd.concat(
        [_curves(con_a, label_a, a.steps, points), _curves(con_b, label_b, b.steps, points)],
        ignore_index=True,
    )
    return CompareData(
        a=a, b=b, stats=pd.DataFrame(rows), curves=curves, partial=(partial_a, partial_b)
    )


def rolled_back(events: pd.DataFrame) -> list[object]:
    """Each event's `rolled_back_from` (None where the column is absent)."""
    if "rolled_back_from" not in events:
        return [None] * len(events)
    return list(events["rolled_back_from"])


def rolled_back_text(step: object) -> str:
    """How an event's `rolled_back_from` is said; "" for an event no restart undid."""
    if not isinstance(step, numbers.Real) or pd.isna(step):  # NULL: pandas' NA or NaN
        return ""
    return f"yes: a restart resumed from step {round(float(step))}"
