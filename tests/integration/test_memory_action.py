"""The memory action in real two-rank torchrun jobs (gloo): a squeeze shrinks the micro-batch
on every rank at one step, an injected OOM is retried smaller with no step lost.

The jobs are the reference workload through `tests.integration.test_actuator.job` (40 steps,
global batch 16 as 8 + 8, windows of 5); rebalancing, compression and checkpoints are off so
only the memory path acts. Per-step micro-batch sizes come from each rank's actuator log,
events and steps from the run store through DuckDB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import free_port
from tests.integration.test_actuator import QUIET, SCRIPTS, STEPS, assert_coverage_exact, job

pytestmark = pytest.mark.integration
ONLY_MEMORY = {**QUIET, "TRAINSPEC_ACTUATOR_REBALANCE": "0", "TRAINSPEC_ACTUATOR_PATIENCE": "2"}


def inject(spec: str) -> dict[str, str]:
    return {"TRAINSPEC_INJECT": spec, "TRAINSPEC_ALLOW_INJECT": "1"}


def steps_table(tmp_path, run_id: str) -> list[tuple[int, int, int, int]]:
    con = store.open(tmp_path / run_id)
    return con.execute(
        "select rank, count(distinct step), min(samples), max(samples) from steps "
        "group by rank order by rank"
    ).fetchall()


@pytest.mark.timeout(150)
def test_a_squeeze_on_one_rank_shrinks_the_micro_batch_on_every_rank_at_one_step(tmp_path):
    logs, events = job(tmp_path, "squeeze", {**ONLY_MEMORY, **inject("squeeze:rank=1,step=7")})
    assert_coverage_exact(logs)
    shrinks = [e for e in events if e[2] == "action" and e[3] == "memory"]
    first_step = min(e[1] for e in shrinks)
    first = [e for e in shrinks if e[1] == first_step]
    assert sorted(e[0] for e in first) == [0, 1], first  # every rank, the same step
    # pressure from step 7: windows ending at 10 and 15 see it; patience 2 -> act at 15,
    # decided one step later (the window's gather runs beside step 16)
    assert first_step == 16
    for _, _, _, _, reason, evidence, before, after in first:
        before, after = json.loads(before), json.loads(after)
        assert after["micro_batch"] == [4, 4] and before["micro_batch"] == [8, 8]
        assert after["accumulation_steps"] == [2, 2] and "memory pressure" in reason
        assert json.loads(evidence)["pressure"][1] == 0.99
    anomaly = [e for e in events if e[3] == "memory_pressure"]
    assert anomaly and json.loads(anomaly[0][5])["ranks"][0] == 1
    for log in logs:  # the plan each rank really ran, step by step
        assert log["micro"][first_step - 1] == [8] and log["micro"][first_step] == [4, 4]
    assert logs[0]["micro"] == logs[1]["micro"]
    assert steps_table(tmp_path, "squeeze") == [(0, STEPS, 8, 8), (1, STEPS, 8, 8)]


@pytest.mark.timeout(150)
def test_an_injected_oom_is_retried_smaller_and_no_step_is_lost(tmp_path):
    env = {**ONLY_MEMORY, **inject("oom:rank=1,step=12,max_micro=4")}
    logs, events = job(tmp_path, "oom", env)
    assert_coverage_exact(logs)  # the retried step trained on the same samples, once
    assert steps_table(tmp_path, "oom") == [(0, STEPS, 8, 8), (1, STEPS, 8, 8)]
    con = store.open(tmp_path / "oom")
    faults = con.execute(
        "select rank, step, reason, before, after from events where kind = 'fault' and name = 'oom'"
    ).fetchall()
    assert len(faults) == 1, faults
    rank, step, reason, before, after = faults[0]
    assert (rank, step) == (1, 12) and "retried with the same samples" in reason
    assert json.loads(before)["micro_batch"] == 8 and json.loads(after)["micro_batch"] == 4
    assert logs[1]["micro"][11] == [8] and logs[1]["micro"][12] == [4, 4]
    assert logs[0]["micro"][12] == [8]  # rank 0 was not short of memory
    reconcile = [e for e in events if e[3] == "memory"]
    assert sorted(e[0] for e in reconcile) == [0, 1] and {e[1] for e in reconcile} == {16}
    assert "out-of-memory retry" in reconcile[0][4]
    # the window ending at 15 is decided at 16 (its gather runs beside that step)
    assert all(log["micro"][16:] == [[4, 4]] * (STEPS - 16) for log in logs)
    assert not any(h["kind"] == "stopped" for h in logs[0]["history"])


@pytest.mark.timeout(150)
def test_dry_run_records_the_shrink_and_keeps_the_micro_batch(tmp_path):
    env = {**ONLY_MEMORY, **inject("squeeze:rank=1,step=7"), "TRAINSPEC_ACTUATOR_DRY_RUN": "1"}
    logs, events = job(tmp_path, "dry-memory", env)
    assert_coverage_exact(logs)
    memory = [e for e in events if e[3] == "memory"]
    assert memory and all(e[4].startswith("dry run, not applied") for e in memory)
    assert {e[0] for e in memory} == {0}  # not applied: recorded once, by rank 0
    assert json.loads(memory[0][7])["micro_batch"] == [4, 4]  # what it would have done
    assert all(m == [8] for log in logs for m in log["micro"])


@pytest.mark.timeout(150)
def test_kill_switch_leaves_the_micro_batch_alone_under_a_squeeze(tmp_path):
    env = {**inject("squeeze:rank=1,step=7"), "TRAINSPEC_ACTUATOR": "off"}
    logs, events = job(tmp_path, "off-memory", env)
    assert events == [] and all(m == [8] for log in logs for m in log["micro"])


@pytest.mark.timeout(120)
def test_micro_batches_and_an_oom_retry_keep_the_ddp_update_the_full_batch_gradient(tmp_path):
    out = tmp_path / "micro-r{rank}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINSPEC_STORE_ROOT": str(tmp_path),
           **inject("oom:rank=1,step=1,max_micro=2")}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPTS / "micro_batch_grad_check.py"),
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(str(out).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    for r in results:  # every step, both ranks: the full-batch gradient
        assert max(r["diffs"]) <= 1e-5 * max(1.0, r["max_abs_grad"]), r["diffs"]
    assert results[0]["micro"] == [[3, 3, 3, 2]] * 3 and results[0]["retries"] == 0
    assert results[1]["micro"] == [[3, 2], [1] * 5, [1] * 5]  # 3 > 2 at step 1: retried at 1
    assert (results[1]["retries"], results[1]["limit"]) == (1, 1)


@pytest.mark.timeout(150)
def test_an_oom_in_the_last_backward_voids_the_exchange_and_every_rank_runs_the_step_again(
    tmp_path,
):
    # No accumulation: the share's one micro-batch is the last, so its backward has buckets in
    # flight when the injected OOM is raised (at the embedding's gradient, late in backward).
    env = {**ONLY_MEMORY, **inject("oom_backward:rank=1,step=12,max_micro=4")}
    logs, events = job(tmp_path, "oom-bwd", env)
    assert_coverage_exact(logs)  # the step ran again on the same samples, once
    assert steps_table(tmp_path, "oom-bwd") == [(0, STEPS, 8, 8), (1, STEPS, 8, 8)]
    con = store.open(tmp_path / "oom-bwd")
    faults = con.execute(
        "select rank, step, name, reason from events where kind = 'fault' order by rank"
    ).fetchall()
    assert [(r, s, n) for r, s, n, _ in faults] == [(0, 12, "step_redone"), (1, 12, "oom")]
    assert "backward" in faults[1][3] and "voided" in faults[0][3]
    assert logs[1]["micro"][12] == [4, 4] and logs[0]["micro"][12] == [8]
    assert not any(h["kind"] == "stopped" for h in logs[0]["history"])


@pytest.mark.timeout(120)
def test_a_step_voided_by_an_oom_in_the_last_backward_still_updates_by_the_full_batch_gradient(
    tmp_path,
):
    out = tmp_path / "void-r{rank}.json"
    # Rank 1 runs its 5 samples as one micro-batch; at step 1 its backward fails (5 > 4) at
    # the token embedding's gradient: with 20 KB buckets DDP has handed the others over by
    # then, so the hook completes the step with the embedding's bucket as zeros.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINSPEC_STORE_ROOT": str(tmp_path),
           "GRAD_CHECK_LIMITS": "3,0", "GRAD_CHECK_BUCKET_MB": "0.02",
           **inject("oom_backward:rank=1,step=1,max_micro=4")}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPTS / "micro_batch_grad_check.py"),
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(str(out).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    for r in results:  # every step, the voided one included: the full-batch gradient
        assert max(r["diffs"]) <= 1e-5 * max(1.0, r["max_abs_grad"]), r["diffs"]
    assert results[0]["micro"] == [[3, 3, 3, 2]] * 3
    assert (results[0]["redone"], results[0]["retries"]) == (1, 0)  # ran step 1 again
    assert results[1]["micro"] == [[5], [2, 2, 1], [2, 2, 1]]
    assert (results[1]["redone"], results[1]["retries"]) == (0, 1)
    assert results[0]["buckets"] >= 3  # several buckets: some were in flight at the OOM
