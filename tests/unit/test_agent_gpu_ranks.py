"""The node's GPU readings stored as the owning rank's rows when the agent did not see the
rank's `runs` row: it restarted, or started after the job (the row went to the rank's own
segments). The mapping comes back from the run's `runs` rows on disk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa

import trainspec.store as store
from tests.unit.agent_fixtures import call, running_agent
from trainspec.collector.records import Batch
from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, encode_tables
from trainspec.store import SegmentWriter
from trainspec.store.tables import RUNS, SAMPLES


def _samples(rank: int) -> pa.Table:
    rows = [{"ts": time.time(), "rank": rank, "metric": "trainspec.host.cpu.utilization",
             "value": 0.5, "attrs": "{}"}]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=SAMPLES)


def _runs(rank: int, local_rank: int, run_id: str = "gpu-run") -> pa.Table:
    row = {"run_id": run_id, "rank": rank, "local_rank": local_rank, "world_size": 16,
           "host": "n", "started_at": time.time(), "device": "cuda", "gpus": "[]",
           "config": "{}", "versions": "{}"}  # fmt: skip
    return pa.Table.from_pylist([row], schema=RUNS)


def _post(port: int, rank: int, tables: dict[str, pa.Table], run_id: str = "gpu-run") -> None:
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": run_id,
               "X-Trainspec-Rank": str(rank)}  # fmt: skip
    status, raw = call(port, "POST", "/v1/trainspec/batches", encode_tables(tables), headers)
    assert status == 200, raw


def _node_gpu_batch(*indices: int) -> Batch:
    """What the NVML node sampler hands the agent: rank -1, one row per GPU."""
    rows = [{"ts": time.time(), "rank": -1, "metric": "trainspec.gpu.utilization",
             "value": 0.9, "attrs": json.dumps({"gpu.index": i})} for i in indices]  # fmt: skip
    return Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], [])


def _gpu_rows(root: Path, run_id: str = "gpu-run") -> dict[int, int]:
    con = store.open(str(root / run_id))
    got = con.execute(
        "SELECT rank, count(*) FROM samples WHERE metric LIKE 'trainspec.gpu.%' GROUP BY rank"
    ).fetchall()
    return dict(got)


def test_a_restarted_agent_still_stores_gpu_readings_as_the_ranks(tmp_path):
    """The sink sends its runs row once, with its first batch, to the first agent."""
    with running_agent(tmp_path, nvml=False) as first:
        _post(first.port, 0, {"samples": _samples(0), "runs": _runs(0, local_rank=1)})
        first._on_node_batch(_node_gpu_batch(0, 1))
    assert _gpu_rows(tmp_path) == {0: 1}  # GPU 1 is rank 0's
    with running_agent(tmp_path, nvml=False) as again:  # no runs row this time
        _post(again.port, 0, {"samples": _samples(0)})
        for _ in range(3):
            again._on_node_batch(_node_gpu_batch(0, 1))
    assert _gpu_rows(tmp_path) == {0: 4}


def test_an_agent_started_after_the_job_finds_the_runs_row_in_the_ranks_own_segments(tmp_path):
    run_dir = tmp_path / "gpu-run"
    # Written by the ranks while no agent answered (sidecar fallback, writer rank-N): rank 3
    # runs here; rank 11 is another node's (shared store) and never sends to this agent.
    SegmentWriter(run_dir, "runs", "rank-3").write(_runs(3, local_rank=0))
    SegmentWriter(run_dir, "runs", "rank-11").write(_runs(11, local_rank=1))
    with running_agent(tmp_path, nvml=False) as agent:
        _post(agent.port, 3, {"samples": _samples(3)})
        agent._on_node_batch(_node_gpu_batch(0, 1))
    assert _gpu_rows(tmp_path) == {3: 1}  # GPU 1 stays unstored: its rank is not here
