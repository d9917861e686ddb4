"""Each GPU's readings go to the job that runs on it, in the store and on /metrics.

Two 2-GPU jobs on one 4-GPU node and one agent: job A on GPUs 0,1 and job B on GPUs 2,3
(CUDA_VISIBLE_DEVICES=2,3, local ranks 0,1 as A's). The agent gave GPU gpu.index ==
local rank to every run, so both stored GPUs 0 and 1 and GPUs 2 and 3 were stored nowhere
(found 2026-11-27). And in sidecar mode the GPU series on /metrics carried only the node's
labels, so every Grafana GPU panel (trainspec_run_id=~"$run") was empty. The node batch is
synthetic (no GPU here); the agent, its HTTP and the sink are the real ones."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

import trainspec.store as store
from tests.unit.agent_fixtures import call, running_agent
from trainspec.collector.records import Batch
from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, AgentSink, encode_tables
from trainspec.store.tables import RUNS, SAMPLES

UUIDS = ["GPU-aaaa0000-1111", "GPU-bbbb0000-2222", "GPU-cccc0000-3333", "GPU-dddd0000-4444"]


def _runs(run_id: str, rank: int, local_rank: int, device: str = "cuda") -> pa.Table:
    row = {"run_id": run_id, "rank": rank, "local_rank": local_rank, "world_size": 2,
           "host": "n", "started_at": time.time(), "device": device, "gpus": "[]",
           "config": "{}", "versions": "{}"}  # fmt: skip
    return pa.Table.from_pylist([row], schema=RUNS)


def _post(port: int, run_id: str, rank: int, local_rank: int, **visible: str) -> None:
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": run_id,
               "X-Trainspec-Rank": str(rank)}  # fmt: skip
    names = {"cuda": "X-Trainspec-Cuda-Visible-Devices",
             "nvidia": "X-Trainspec-Nvidia-Visible-Devices"}  # fmt: skip
    headers.update({names[k]: v for k, v in visible.items()})
    body = encode_tables({"runs": _runs(run_id, rank, local_rank)})
    status, raw = call(port, "POST", "/v1/trainspec/batches", body, headers)
    assert status == 200, raw


def _node_batch() -> Batch:
    """Four GPUs; GPU i draws 100 * (i + 1) W."""
    rows = [{"ts": time.time(), "rank": -1, "metric": "trainspec.gpu.power",
             "value": 100.0 * (i + 1), "attrs": json.dumps({"gpu.index": i, "hw.id": UUIDS[i]})}
            for i in range(4)]  # fmt: skip
    return Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], [])


def _stored(root: Path, run_id: str) -> list[tuple[int, float]]:
    if not (root / run_id).exists():
        return []
    con = store.open(str(root / run_id))
    try:
        return con.execute(
            "SELECT rank, value FROM samples WHERE metric = 'trainspec.gpu.power' ORDER BY rank"
        ).fetchall()
    finally:
        con.close()


def _power_series(port: int) -> list[dict[str, str]]:
    _, text = call(port, "GET", "/metrics")
    return [
        {**s.labels, "value": str(s.value)}
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
        if s.name.startswith("trainspec_gpu_power")
    ]


def test_two_jobs_each_store_their_own_gpus(tmp_path):
    with running_agent(tmp_path, nvml=False) as agent:
        for rank in (0, 1):
            _post(agent.port, "jobA", rank, rank, cuda="0,1")
            _post(agent.port, "jobB", rank, rank, cuda="2,3")
        agent._on_node_batch(_node_batch())
    assert _stored(tmp_path, "jobA") == [(0, 100.0), (1, 200.0)]
    assert _stored(tmp_path, "jobB") == [(0, 300.0), (1, 400.0)]


@pytest.mark.parametrize(
    ("visible", "want"),
    [
        ({"cuda": "GPU-cccc"}, 300.0),  # a UUID prefix, as CUDA takes it
        ({"nvidia": f"{UUIDS[1]},{UUIDS[3]}"}, 200.0),  # the container's GPU 0: the device
        ({"nvidia": "1,3", "cuda": "1"}, 400.0),  # plugin's; CUDA counts among those
        ({"nvidia": f"{UUIDS[3]},{UUIDS[1]}"}, 200.0),  # in bus order, as CUDA numbers them
        ({"cuda": "2, 3,x,0"}, 300.0),  # read as CUDA reads it: up to the first bad entry
    ],
)  # fmt: skip
def test_a_rank_maps_to_the_gpu_its_visible_devices_name(tmp_path, visible, want):
    with running_agent(tmp_path, nvml=False) as agent:
        _post(agent.port, "job", 0, 0, **visible)
        agent._on_node_batch(_node_batch())
    assert _stored(tmp_path, "job") == [(0, want)]


def test_a_rank_that_reports_nothing_does_not_take_another_jobs_gpu(tmp_path, caplog):
    """An older rank (no report) is assumed on GPU == local rank, unless another rank has
    that GPU: then it gets none, said once, rather than job A's readings."""
    with running_agent(tmp_path, nvml=False) as agent:
        for rank in (0, 1):
            _post(agent.port, "jobA", rank, rank, cuda="0,1")
            _post(agent.port, "jobB", rank, rank)
        with caplog.at_level(logging.WARNING, logger="trainspec.agent"):
            for _ in range(3):
                agent._on_node_batch(_node_batch())
    assert _stored(tmp_path, "jobA") == [(0, 100.0), (0, 100.0), (0, 100.0),
                                         (1, 200.0), (1, 200.0), (1, 200.0)]  # fmt: skip
    assert _stored(tmp_path, "jobB") == []
    said = [r.getMessage() for r in caplog.records if "jobB" in r.getMessage()]
    assert len(said) == 2, said  # once per rank of job B, not once per node batch
    assert "claimed by jobA rank 0" in said[0] and "CUDA_VISIBLE_DEVICES" in said[0]


@pytest.mark.parametrize("visible", [{"cuda": "3"}, {"cuda": "MIG-1234"}, {"cuda": "GPU-ffff"}])
def test_a_report_naming_no_single_gpu_stores_none_and_says_why(tmp_path, caplog, visible):
    with running_agent(tmp_path, nvml=False) as agent:
        _post(agent.port, "job", 1, 1, **visible)  # local rank 1: past "3"'s one device
        with caplog.at_level(logging.WARNING, logger="trainspec.agent"):
            agent._on_node_batch(_node_batch())
    assert _stored(tmp_path, "job") == []
    assert any("run job rank 1" in r.getMessage() for r in caplog.records)


def test_a_cpu_rank_owns_no_gpu(tmp_path):
    with running_agent(tmp_path, nvml=False) as agent:
        headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": "job",
                   "X-Trainspec-Rank": "0"}  # fmt: skip
        body = encode_tables({"runs": _runs("job", 0, 0, device="cpu")})
        assert call(agent.port, "POST", "/v1/trainspec/batches", body, headers)[0] == 200
        agent._on_node_batch(_node_batch())
    assert _stored(tmp_path, "job") == []


def test_the_sink_reports_the_ranks_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    with running_agent(tmp_path / "store", nvml=False) as agent:
        sink = AgentSink(f"http://127.0.0.1:{agent.port}", run_id="jobB", rank=1,
                         run_dir=tmp_path / "own", writer="rank-1")  # fmt: skip
        sink.write_run_row(_runs("jobB", 1, 1))
        rows = [{"ts": time.time(), "rank": 1, "metric": "trainspec.host.memory.used",
                 "value": 1.0, "attrs": "{}"}]  # fmt: skip
        sink.write(Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], []))
        sink.close()
        assert sink.sent_batches == 1
        agent._on_node_batch(_node_batch())
    assert _stored(tmp_path / "store", "jobB") == [(1, 400.0)]


def test_a_ranks_gpu_series_on_metrics_carry_its_run_and_rank(tmp_path):
    """What Grafana's GPU panels select (trainspec_run_id, trainspec_rank), as an embedded
    rank's own GPU series carry them; a GPU no rank owns stays the node's."""
    with running_agent(tmp_path, nvml=False) as agent:
        _post(agent.port, "jobA", 0, 0, cuda="0")
        _post(agent.port, "jobB", 1, 1, cuda="0,2")
        agent._on_node_batch(_node_batch())
        series = _power_series(agent.port)
    by_gpu = {s["gpu_index"]: s for s in series}
    assert len(series) == 4, series  # each GPU once: no node copy beside the rank's
    assert by_gpu["0"]["trainspec_run_id"] == "jobA" and by_gpu["0"]["trainspec_rank"] == "0"
    assert by_gpu["2"]["trainspec_run_id"] == "jobB" and by_gpu["2"]["trainspec_rank"] == "1"
    assert by_gpu["2"]["value"] == "300.0" and by_gpu["2"]["hw_id"] == UUIDS[2]
    for free in ("1", "3"):
        assert "trainspec_run_id" not in by_gpu[free]
        assert by_gpu[free]["service_name"] == "trainspec-agent"
