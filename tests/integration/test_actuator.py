"""The actuator in real two-rank torchrun jobs (gloo) with injected faults.

Each job is the reference workload (`train_gpt.py`) with `--actuator-log`, so every rank
reports per step the shares and sample indices it trained on, and the controller's history;
events are read back from the run store through DuckDB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import free_port, torchrun

pytestmark = pytest.mark.integration
SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS, GLOBAL_BATCH, WINDOW = 40, 16, 5
QUIET = {"TRAINSPEC_ACTUATOR_COMPRESSION": "0", "TRAINSPEC_ACTUATOR_CHECKPOINT": "0"}


def slow(rank: int, factor: float) -> dict[str, str]:
    return {"TRAINSPEC_INJECT": f"slow:rank={rank},factor={factor}", "TRAINSPEC_ALLOW_INJECT": "1"}


def job(tmp_path: Path, run_id: str, env: dict[str, str], extra: list[str] | None = None):
    log = tmp_path / f"{run_id}-r{{rank}}.json"
    args = [f"--steps={STEPS}", f"--global-batch={GLOBAL_BATCH}", "--batch-size=8",
            "--max-bytes=300000", "--layers=1", "--embd=64", f"--actuator-log={log}",
            *(extra or [])]  # fmt: skip
    env = {"TRAINSPEC_ACTUATOR_WINDOW_STEPS": str(WINDOW), **env}
    torchrun(tmp_path, run_id, env=env, script_args=args, timeout_s=90)
    logs = [json.loads(Path(str(log).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    con = store.open(tmp_path / run_id)
    events = con.execute(
        "select rank, step, kind, name, reason, evidence, before, after from events "
        "where kind in ('anomaly', 'action') order by step, rank"
    ).fetchall()
    return logs, events


def assert_coverage_exact(logs: list[dict]) -> None:
    seen: list[int] = []
    for step in range(STEPS):
        shares = [log["shares"][step] for log in logs]
        assert shares[0] == shares[1], f"ranks disagree on shares at step {step}"
        assert sum(shares[0]) == GLOBAL_BATCH
        for r, log in enumerate(logs):
            assert len(log["indices"][step]) == shares[0][r]
            seen += log["indices"][step]
    assert len(seen) == len(set(seen)) == STEPS * GLOBAL_BATCH  # one epoch: nothing repeated


@pytest.mark.timeout(120)
def test_slow_rank_is_detected_and_rebalanced_within_bounds(tmp_path):
    logs, events = job(tmp_path, "straggler", {**slow(1, 2.0), **QUIET})
    assert_coverage_exact(logs)
    history = logs[0]["history"]
    rebalances = [h for h in history if h["kind"] == "rebalance" and h["applied"]]
    assert rebalances, f"no rebalance; history {history}, {logs[0]['stopped']}, {logs[0]['cost']}"
    first = rebalances[0]
    # patience 3 windows + one spare, + 1: a window is decided a step after it ends
    assert first["step"] <= 4 * WINDOW + 1, "detected later than its step budget"
    assert first["after"]["shares"][1] < first["after"]["shares"][0]  # the slow rank gets less
    limit = 0.75 * GLOBAL_BATCH / 2  # rebalance_max_change x the equal share
    for h in rebalances:
        before, after = h["before"]["shares"], h["after"]["shares"]
        assert max(abs(a - b) for a, b in zip(before, after)) <= limit + 1
    assert logs[1]["history"] == history  # the same plan, decided alike on both ranks
    switch = first["step"]
    assert (
        logs[0]["shares"][switch - 1] == [8, 8]
        and logs[0]["shares"][switch] == first["after"]["shares"]
    )
    names = {(rank, kind, name) for rank, _, kind, name, *_ in events}
    assert {
        (0, "anomaly", "straggler"),
        (0, "action", "rebalance"),
        (1, "action", "rebalance"),
    } <= names
    straggler = next(e for e in events if e[3] == "straggler")
    assert json.loads(straggler[5])["ranks"] == [1] and "slower than the fastest" in straggler[4]
    cost = logs[0]["cost"]
    # the last window's gather completes at close, after training: nothing left to decide
    assert cost["windows"] == STEPS // WINDOW - 1 and 0 < cost["per_step_s"] < 0.05


@pytest.mark.timeout(120)
def test_dry_run_advises_and_changes_nothing(tmp_path):
    # 3x, not 2x: a neighbour's load on a shared 2-core host can hide a 2x rank for the few
    # windows this short run has, and this test is about what a dry run does once it detects.
    logs, events = job(
        tmp_path, "dry", {**slow(1, 3.0), **QUIET, "TRAINSPEC_ACTUATOR_DRY_RUN": "1"}
    )
    assert_coverage_exact(logs)
    assert all(s == [8, 8] for log in logs for s in log["shares"])
    advised = [e for e in events if e[3] == "rebalance"]
    assert advised and all(e[4].startswith("dry run, not applied") for e in advised)
    assert {e[0] for e in advised} == {0}  # advice is recorded once, by rank 0


@pytest.mark.timeout(120)
def test_kill_switch_turns_the_actuator_off(tmp_path):
    logs, events = job(tmp_path, "off", {**slow(1, 2.0), "TRAINSPEC_ACTUATOR": "off"})
    assert not logs[0]["enabled"] and not logs[1]["enabled"]
    assert all(s == [8, 8] for log in logs for s in log["shares"])
    assert events == []


@pytest.mark.timeout(120)
def test_the_kill_switch_on_one_rank_turns_the_actuator_off_on_every_rank(tmp_path):
    """Off on rank 1 only: rank 0 waited in the control gather for its timeout (60 s), then
    recorded "actuator stopped". Now the ranks agree when `actuate` runs."""
    log = tmp_path / "one-r{rank}.json"
    args = [f"--steps={STEPS}", f"--global-batch={GLOBAL_BATCH}", "--batch-size=8",
            "--max-bytes=300000", "--layers=1", "--embd=64", f"--actuator-log={log}"]  # fmt: skip
    env = {"TRAINSPEC_ACTUATOR_WINDOW_STEPS": str(WINDOW),
           "TEST_ONE_RANK_ENV": "1:TRAINSPEC_ACTUATOR=off"}  # fmt: skip
    torchrun(tmp_path, "one", env=env, script_args=args, timeout_s=90,
             script=SCRIPTS / "one_rank_env.py")  # fmt: skip
    logs = [json.loads(Path(str(log).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    assert not logs[0]["enabled"] and not logs[1]["enabled"]
    stopped = store.query(tmp_path / "one", "SELECT count(*) AS n FROM events WHERE reason "
                          "LIKE '%actuator stopped%'").column("n")[0].as_py()  # fmt: skip
    assert stopped == 0


@pytest.mark.timeout(120)
def test_noisy_healthy_run_triggers_nothing(tmp_path):
    logs, events = job(tmp_path, "healthy", QUIET)
    # An advice changes nothing: a shared CI host's real latency spike (the probe's median
    # 4.35 ms against 1.155 ms for 3 windows) is advised about, rightly, in a healthy run.
    acted = [h for h in logs[0]["history"] if h["kind"] not in ("stopped", "advice")]
    flagged = [e for e in events if e[3] == "straggler" and not e[4].startswith("cleared")]
    if not flagged:
        assert acted == [], f"a healthy run acted without a straggler: {acted}"
        assert all(s == [8, 8] for s in logs[0]["shares"])
        return
    # This machine's cores are shared: another tenant can make a rank really slower for
    # several windows. Then the action must rest on that evidence, never precede it.
    first = min(e[1] for e in flagged)
    assert all(h["kind"] == "rebalance" and h["step"] >= first for h in acted)
    assert all(json.loads(e[5])["score"] < 0.8 for e in flagged)


@pytest.mark.timeout(120)
def test_compression_and_checkpoint_policies_act_alike_on_every_rank(tmp_path):
    env = {
        "TRAINSPEC_ACTUATOR_COMM_BOUND_SHARE": "0.01",  # make this CPU job count as comm-bound
        "TRAINSPEC_INJECT": "spike:step=27,factor=20",
        "TRAINSPEC_ALLOW_INJECT": "1",
    }
    ckpt = tmp_path / "ckpt"
    logs, events = job(tmp_path, "policies", env, extra=[f"--ckpt-dir={ckpt}"])
    assert logs[0]["levels"] == logs[1]["levels"]
    assert "bf16" in logs[0]["levels"], logs[0]["history"]
    kinds = [(h["step"], h["kind"]) for h in logs[0]["history"]]
    # Decisions land one step after their window ends (the gather runs beside that step).
    assert (WINDOW + 1, "checkpoint") in kinds  # the first one measures the cost
    assert (31, "checkpoint") in kinds  # the spike at step 27 is in the window ending at 30
    spike = [e for e in events if e[3] == "loss_spike"]
    assert spike and spike[0][1] == 31
    committed = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert committed, "no checkpoint directory written"


@pytest.mark.timeout(90)
def test_rebalanced_update_equals_the_full_batch_gradient(tmp_path):
    out = tmp_path / "grad-r{rank}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINSPEC_STORE_ROOT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPTS / "actuator_grad_check.py"),
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(str(out).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    for r in results:
        assert r["shares"] == [11, 5]
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs_grad"])
    assert len(results[0]["indices"]) == 11 and len(results[1]["indices"]) == 5


@pytest.mark.timeout(120)
def test_a_hardware_fault_on_one_rank_checkpoints_every_rank_at_once(tmp_path):
    env = {
        **QUIET,
        "TRAINSPEC_ACTUATOR_CHECKPOINT": "1",
        "TRAINSPEC_ACTUATOR_REBALANCE": "0",
        "TRAINSPEC_INJECT": "ecc:rank=1,step=12",
        "TRAINSPEC_ALLOW_INJECT": "1",
    }
    ckpt = tmp_path / "ckpt"
    logs, events = job(tmp_path, "hardware", env, extra=[f"--ckpt-dir={ckpt}"])
    # Rank 1's watch saw the ECC count rise at the end of step 12 and said why, in words.
    (own,) = [e for e in events if e[3] == "hardware" and e[0] == 1 and e[2] == "anomaly"
              and "ECC" in e[4]]  # fmt: skip
    assert own[1] == 13 and json.loads(own[5])["kind"] == "ecc"
    # The flag went into the window ending at step 15; every rank checkpointed at step 16.
    for log in logs:
        kinds = [(h["step"], h["kind"]) for h in log["history"]]
        assert (16, "checkpoint") in kinds, kinds
    shared = [e for e in events if e[3] == "hardware" and e[0] == 0 and e[2] == "anomaly"]
    assert shared and shared[0][1] == 16
    assert any(p.is_dir() for p in ckpt.iterdir()), "no checkpoint directory written"


@pytest.mark.timeout(120)
def test_a_latency_spike_on_one_rank_is_detected_named_and_advised(tmp_path):
    # Probing every 10 ms: this job's steps are short, and a window needs readings. 200 ms
    # on top of readings that hold a busy host's scheduling delay (several ms on two loaded
    # cores; 20 ms was missed under heavy load, when three times the baseline exceeded it).
    env = {**QUIET, "TRAINSPEC_ACTUATOR_REBALANCE": "0", "TRAINSPEC_COLLECTOR_INTERVAL_S": "0.01",
           "TRAINSPEC_INJECT": "latency:rank=1,step=20,ms=200",
           "TRAINSPEC_ALLOW_INJECT": "1"}  # fmt: skip
    logs, events = job(tmp_path, "latency", env)
    spikes = [e for e in events if e[3] == "latency_spike" and e[2] == "anomaly"]
    assert spikes, [e[:5] for e in events]
    first = spikes[0]
    # The spike's third window (patience 3) closes at step 35; its decision lands a step later.
    # One window earlier (31) when the window ending at step 20 already read high, from host
    # load on two busy cores (the probe reads scheduling delay too) or from the injected
    # step-20 readings: seen once in CI. The detector wants three high windows in a row, so
    # never before the spike's second window closes.
    assert first[1] in (31, 36) and "rank 1" in first[4]
    evidence = json.loads(first[5])
    assert evidence["rank"] == 1 and evidence["ratio"] >= 3
    advice = [e for e in events if e[2] == "action" and e[3] == "advice" and e[1] == first[1]]
    assert advice and "links" in advice[0][4]
