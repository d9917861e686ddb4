"""Dashboards over the run store: a live Streamlit app, a static report, a Grafana dashboard.

Contract:
- `data` loads what each view shows from a connection of `trainspec.store.open(run)` and
  returns pandas frames downsampled in SQL (at most ~600 buckets per series), so a run of a
  million samples loads in well under 2 s. The app, the report and the benchmark share it.
  Aggregates skip NaN and +-inf (`sql.finite`; a bucket with no finite value is NULL) and
  `RunSummary.nonfinite` counts what was skipped. The rank heatmap has at most 32 rows:
  beyond 32 ranks each row is a group of consecutive ranks (`0-31`) showing its slowest.
  Up to 8 ranks (`data.LINE_RANKS`) every rank has its own line and phases bar; beyond,
  the overview gets each bucket's spread across ranks (median, p10, p90, min, max) and the
  3 slowest ranks' own lines (`stragglers`), O(buckets) rows whatever the rank count. The
  stragglers table lists the slowest 20 ranks first and says how many more there are.
- `app.py` is the Streamlit script (`trainspec dashboard RUN_ROOT`): run picker (the root
  re-listed every 2 s, so a new run appears on its own), live refresh every 2 s while a run
  is being written (views over immutable Parquet segments, never a writer's open file),
  views Overview, Actions, Compliance, Compare, Hardware. Compare counts only steps every
  rank reported; Hardware draws a line per physical GPU (`hw.id`, else host and index).
- `report.render_report(run, html=..., png_dir=...)` draws the headline plots with matplotlib
  (Agg backend) for a CI artifact or a paper (`trainspec report RUN`).
- `grafana/trainspec.json` is a Grafana dashboard for a Prometheus data source, written
  only in the catalogue's Prometheus names (`grafana.build_dashboard` generates it).
- `compliance.check_run` is the one place the compliance validator is called.
Streamlit, pandas and matplotlib are the `dashboard` extra: nothing here imports at
`trainspec` import time, and this package imports only `schema` and `store`.
"""
