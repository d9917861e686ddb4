"""The per-rank summary table printed by `trainspec demo` (and reusable by reports)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

SUMMARY_SQL = """
WITH s AS (
  SELECT rank,
    median(duration_s) AS step_p50_s,
    quantile_cont(duration_s, 0.95) AS step_p95_s,
    avg(data_wait_s / nullif(duration_s, 0)) AS data_wait_share,
    avg(grad_variance) AS grad_variance,
    last(grad_noise_scale ORDER BY step) AS noise_scale,
    last(loss ORDER BY step) AS last_loss,
    count(*) AS steps
  FROM steps GROUP BY rank
), m AS (
  SELECT rank,
    avg(value) FILTER (WHERE metric = 'trainspec.gpu.utilization') AS gpu_util,
    avg(value) FILTER (WHERE metric = 'trainspec.process.cpu.utilization') AS cpu_util,
    max(value) FILTER (WHERE metric = 'trainspec.memory.pressure') AS mem_pressure_max,
    quantile_cont(value, 0.95) FILTER (WHERE metric = 'trainspec.comm.probe.latency') AS latency_p95_s,
    max(value) FILTER (WHERE metric = 'trainspec.telemetry.dropped') AS dropped
  FROM samples GROUP BY rank
)
SELECT s.rank, s.steps, s.step_p50_s, s.step_p95_s, s.data_wait_share,
  coalesce(m.gpu_util, m.cpu_util) AS utilization, m.mem_pressure_max, m.latency_p95_s,
  s.grad_variance, s.noise_scale, s.last_loss, m.dropped
FROM s LEFT JOIN m USING (rank) ORDER BY s.rank
"""


def run_summary(run: str | Path) -> pa.Table:
    from trainspec.store import query

    return query(run, SUMMARY_SQL)
