"""The dashboard's loaders on synthetic runs: shapes, downsampling, live refresh, errors."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import trainspec.store as store
from tests.helpers.dashboard_runs import (
    T0,
    _columns,
    _event,
    append_steps,
    make_dashboard_run,
    make_wide_run,
    runs_rows,
    samples_table,
)
from trainspec.dashboards.compliance import NOT_INSTALLED, check_run
from trainspec.dashboards.data import (
    load_actions,
    load_compare,
    load_hardware,
    load_overview,
)
from trainspec.dashboards.runs import DashboardError, list_runs
from trainspec.store import SegmentWriter
from trainspec.store.reader import refresh
from trainspec.store.tables import to_arrow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_dashboard_run(tmp_path_factory.mktemp("runs") / "run-a", ranks=4, seconds=60.0)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    return make_dashboard_run(
        tmp_path_factory.mktemp("gpu") / "run-gpu", ranks=2, seconds=10.0, gpus=True, seed=3
    )


def test_overview_names_the_straggler_and_keeps_every_rank(run_dir):
    data = load_overview(store.open(run_dir))
    assert data.summary.ranks == [0, 1, 2, 3]
    assert data.summary.steps == 240
    worst = data.stragglers.sort_values("ratio").iloc[-1]
    assert int(worst["rank"]) == 3 and worst["ratio"] > 1.2
    others = data.stragglers[data.stragglers["rank"] != 3]["ratio"]
    assert (others < 1.1).all()
    assert set(data.series["metric"]) == {
        "trainspec.process.cpu.utilization",
        "trainspec.memory.pressure",
        "trainspec.comm.probe.latency",
    }
    phases = data.phases.groupby("rank")["seconds"].sum()
    steps = store.query(run_dir, "SELECT rank, avg(duration_s) AS d FROM steps GROUP BY rank")
    for rank, mean in zip(steps["rank"].to_pylist(), steps["d"].to_pylist()):
        assert phases[rank] == pytest.approx(mean, rel=1e-6)  # phases add up to the step


def test_series_are_downsampled_in_sql(run_dir):
    data = load_overview(store.open(run_dir), points=50)
    per_series = data.series.groupby(["metric", "rank"]).size()
    assert per_series.max() <= 51  # 1200 samples per series became at most ~50 buckets
    assert data.step_time.groupby("rank").size().max() <= 50
    assert data.heatmap.groupby("rank").size().max() <= 120
    assert (data.series["peak"] >= data.series["value"] - 1e-12).all()


def test_actions_are_listed_once_with_their_ranks_and_evidence(run_dir):
    data = load_actions(store.open(run_dir))
    assert list(data.events["name"]) == [
        "straggler", "rebalance", "loss_spike", "anomaly", "compression",
    ]  # fmt: skip
    rebalance = data.events[data.events["name"] == "rebalance"].iloc[0]
    assert list(rebalance["ranks"]) == [0, 1, 2, 3]
    assert '"shares"' in rebalance["before"] and '"ratio"' in rebalance["evidence"]
    assert not data.timeline.empty


def test_refresh_shows_steps_written_after_the_connection_opened(tmp_path):
    run = make_dashboard_run(tmp_path / "live", ranks=2, seconds=5.0)
    con = store.open(run)
    before = load_overview(con).summary.steps
    append_steps(run, ranks=2, first_step=before, count=8)
    refresh(con)
    assert load_overview(con).summary.steps == before + 8


def test_hardware_without_and_with_gpus(run_dir, gpu_run):
    cpu = load_hardware(store.open(run_dir))
    assert cpu.gpus == [] and cpu.series.empty
    gpu = load_hardware(store.open(gpu_run))
    assert [g["index"] for g in gpu.gpus] == [0, 1]
    assert set(gpu.series["gpu"]) == {"GPU 0", "GPU 1"}  # one host: the index names it
    assert "trainspec.gpu.utilization" in set(gpu.series["metric"])


def _two_node_gpu_run(run_dir, *, hosts: tuple[str, str], hw_ids: bool):
    """Rank r on `hosts[r]` drives that node's GPU 0, as every node of a multi-node job has
    its GPU 0; rank 1's GPU is busier (the straggler's). With `hw_ids` the samples carry
    the NVML UUID (`hw.id`), without it only the index."""
    rng = np.random.default_rng(5)
    rows = runs_rows(run_dir.name, 2, gpus=True)
    for rank, row in enumerate(rows):
        row.update(host=hosts[rank], local_rank=0)
    runs = to_arrow("runs", {k: [r[k] for r in rows] for k in rows[0]})
    for rank in range(2):
        samples = samples_table(rank, 5.0, 1, True, rng)
        attrs = {"gpu.index": 0, **({"hw.id": f"GPU-node{rank}"} if hw_ids else {})}
        gpu_rows = [m.startswith("trainspec.gpu.") for m in samples["metric"].to_pylist()]
        column = pa.array([json.dumps(attrs) if g else "{}" for g in gpu_rows], pa.string())
        samples = samples.set_column(samples.schema.get_field_index("attrs"), "attrs", column)
        SegmentWriter(run_dir, "samples", f"rank-{rank}").write(samples)
        mine = runs.filter(pa.compute.equal(runs["rank"], rank))
        SegmentWriter(run_dir, "runs", f"rank-{rank}").write(mine)
    return run_dir


@pytest.mark.parametrize(
    ("hosts", "hw_ids", "labels"),
    [
        (("node-0", "node-1"), False, ("node-0 GPU 0", "node-1 GPU 0")),
        (("node-0", "node-1"), True, ("node-0 GPU 0", "node-1 GPU 0")),
        (("node", "node"), True, ("GPU 0 (GPU-node0)", "GPU 0 (GPU-node1)")),  # one host name
    ],
    ids=["hosts", "hosts-and-hw.id", "hw.id"],
)
def test_gpu_0_of_two_nodes_is_two_lines(tmp_path, hosts, hw_ids, labels):
    """Every node has a GPU 0: the series were grouped by index alone, so the two nodes'
    GPU 0 were one line averaging both (~0.78, neither GPU's utilization)."""
    run = _two_node_gpu_run(tmp_path / "two-nodes", hosts=hosts, hw_ids=hw_ids)
    series = load_hardware(store.open(run)).series
    util = series[series["metric"] == "trainspec.gpu.utilization"]
    means = util.groupby("gpu")["value"].mean()
    assert set(means.index) == set(labels)
    assert means[labels[0]] == pytest.approx(0.65, abs=0.05)
    assert means[labels[1]] == pytest.approx(0.9, abs=0.05)


def test_compare_two_runs(run_dir, gpu_run):
    data = load_compare(store.open(run_dir), store.open(gpu_run))
    stats = data.stats.set_index("statistic")
    assert stats.loc["steps", "a"] == 240 and stats.loc["steps", "b"] == 40
    assert stats.loc["steps", "ratio"] == pytest.approx(40 / 240)
    assert set(data.curves["run"]) == {"run-a", "run-gpu"}


def test_compare_counts_only_steps_every_rank_reported(run_dir, tmp_path):
    """Steps 20-27 of B have rank 0's rows only (rank 1 has not flushed them): they were
    counted as steps, their step time was rank 0's alone and their throughput half a step's."""
    b = make_dashboard_run(tmp_path / "half", ranks=2, seconds=5.0)
    append_steps(b, ranks=1, first_step=20, count=8)  # rank 0 only
    data = load_compare(store.open(run_dir), store.open(b))
    stats = data.stats.set_index("statistic")
    assert stats.loc["steps", "b"] == 20
    assert data.partial == (0, 8)
    curve_b = data.curves[data.curves["run"] == "half"]
    assert curve_b["step"].max() == 19
    whole = store.query(b, "SELECT max(duration_s) AS d FROM steps WHERE step < 20 GROUP BY step")
    median = float(np.median(whole["d"].to_numpy()))
    assert stats.loc["median step time (s)", "b"] == pytest.approx(median)


def test_list_runs_newest_first_and_live(tmp_path):
    old = make_dashboard_run(tmp_path / "old", ranks=2, seconds=2.0)
    new = make_dashboard_run(tmp_path / "new", ranks=2, seconds=2.0)
    past = time.time() - 3600
    for p in old.rglob("*.parquet"):
        os.utime(p, (past, past))
    (tmp_path / "not-a-run").mkdir()
    runs = list_runs(tmp_path)
    assert [r.name for r in runs] == ["new", "old"]
    assert runs[0].live and not runs[1].live
    assert [r.path for r in list_runs(new)] == [new]  # a run directory is its own root
    with pytest.raises(DashboardError, match="no such runs directory"):
        list_runs(tmp_path / "missing")


def test_compliance_adapter(run_dir):
    result = check_run(run_dir)
    assert result.available and result.compliant is False  # host metrics are absent
    assert "trainspec.host.cpu.utilization" in set(result.violations["metric"])
    missing = check_run(run_dir, module="trainspec.no_such_validator")
    assert not missing.available and missing.headline == NOT_INSTALLED
    bad = check_run(run_dir / "nope")
    assert bad.compliant is None and bad.error


def test_compliance_adapter_groups_what_every_rank_shares(tmp_path):
    """1,024 ranks missing 8 metrics: every violation kept, 8 rows for people to read."""
    result = check_run(make_wide_run(tmp_path / "wide", ranks=1024, seconds=2.0, samples=False))
    assert len(result.violations) == 8192 and set(result.violations["rank"]) == set(range(1024))
    assert list(result.groups.columns) == ["metric", "ranks", "rule", "evidence", "violations"]
    assert len(result.groups) == 8 and set(result.groups["ranks"]) == {"1,024 ranks (0-1023)"}
    assert result.groups["violations"].sum() == 8192
    assert result.headline.startswith("8192 violations of catalogue")
    assert result.headline.endswith(" in 8 groups")


def test_a_run_that_has_not_flushed_yet_is_live(tmp_path):
    """A run opened in its first seconds, with no segment yet, counted as not live, and the
    page never refreshed to show the run's data."""
    from trainspec.dashboards.runs import run_entry

    fresh = tmp_path / "fresh"
    (fresh / "segments").mkdir(parents=True)
    assert run_entry(fresh).live
    past = time.time() - 3600
    os.utime(fresh, (past, past))
    assert not run_entry(fresh).live  # an empty run left for an hour is not


def test_compare_counts_a_step_run_again_after_a_restart_once(run_dir, tmp_path):
    """A job resumed from a checkpoint at step 10 runs steps 10-19 again; both attempts'
    rows stay. Their samples were summed, doubling those steps' throughput."""
    b = make_dashboard_run(tmp_path / "resumed", ranks=2, seconds=5.0)
    before = load_compare(store.open(run_dir), store.open(b)).stats.set_index("statistic")
    again = store.query(b, "SELECT * FROM steps WHERE step BETWEEN 10 AND 19")
    again = again.set_column(0, "ts", pa.compute.add(again["ts"], 100.0))  # the second attempt
    SegmentWriter(b, "steps", "rank-0-again").write(again)
    after = load_compare(store.open(run_dir), store.open(b)).stats.set_index("statistic")
    assert after.loc["steps", "b"] == before.loc["steps", "b"]
    for name in ("median throughput (samples/s)", "median step time (s)"):
        assert after.loc[name, "b"] == pytest.approx(before.loc[name, "b"]), name


def restarted(run_dir, ranks: int, *, loaded_step: int | None, again: bool = True):
    """A second attempt of every rank: torchrun restarted it (`restart` 1 in its runs row)
    after every event of the first; it loaded the checkpoint of `loaded_step` (None: found
    none, started over) and, `again`, made the first attempt's compression switch anew."""
    end = T0 + 100.0
    runs = runs_rows(run_dir.name, ranks, False)
    events = []
    for row in runs:
        row["started_at"], row["config"] = end, json.dumps({"restart": 1})
        r = row["rank"]
        if loaded_step is not None:
            events.append(_event(r, 0, "checkpoint", "loaded", "info", "checkpoint loaded",
                                 evidence={"step": loaded_step}))  # fmt: skip
        if again:
            events.append(_event(r, 64, "action", "compression", "info",
                                 "exposed communication above 20% of step time: compress "
                                 "gradients", evidence={"comm_exposed_share": 0.24},
                                 before={"level": "none"}, after={"level": "int8"}))  # fmt: skip
    for e in events:
        e["ts"] += 100.0  # after the restart
    for table, rows in (("runs", runs), ("events", events)):
        if rows:
            SegmentWriter(run_dir, table, "attempt-1").write(to_arrow(table, _columns(rows)))


def _rolled(data) -> dict[tuple[str, int], list]:
    ev = data.events[data.events["kind"] == "action"]
    out: dict[tuple[str, int], list] = {}
    for name, step, back in zip(ev["name"], ev["step"], ev["rolled_back_from"], strict=True):
        out.setdefault((name, int(step)), []).append(None if pd.isna(back) else int(back))
    return out


def test_actions_a_restart_rolled_back_are_marked(tmp_path):
    """QA bug 7: a job resumed from step 6 kept its killed attempt's rebalances at 16 and
    21 in the report as if in effect. An action past the step the next attempt resumed from
    is marked with that step; one at or before it, and the later attempt's own, are not."""
    run = make_dashboard_run(tmp_path / "resumed", ranks=2, seconds=20.0)  # actions at 40, 64
    assert all(pd.isna(v) for v in load_actions(store.open(run)).events["rolled_back_from"])
    restarted(run, 2, loaded_step=50)
    data = load_actions(store.open(run))
    assert _rolled(data) == {("rebalance", 40): [None], ("compression", 64): [50, None]}
    compression = data.events[data.events["name"] == "compression"]
    assert [list(r) for r in compression["ranks"]] == [[0, 1], [0, 1]]  # each once, both ranks

    over = make_dashboard_run(tmp_path / "over", ranks=2, seconds=20.0)
    restarted(over, 2, loaded_step=None, again=False)  # no checkpoint: started over from 0
    assert _rolled(load_actions(store.open(over))) == {
        ("rebalance", 40): [0], ("compression", 64): [0],
    }  # fmt: skip
