"""The compression hook on real gloo process groups of 2 and 4 ranks (spawned processes).

Each test runs one scenario of scripts/kernels_hook_worker.py under a hard timeout; rank 0
writes its measurements as JSON, read back here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
WORKER = Path(__file__).parent / "scripts" / "kernels_hook_worker.py"


def _run(scenario: str, world: int, tmp_path: Path, timeout_s: int) -> dict:
    out = tmp_path / f"{scenario}-{world}.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(
        [sys.executable, str(WORKER), scenario, str(world), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


# Per-step tolerance of each level against a plain float32 all-reduce, relative L2 error.
# none is exact; bf16 ~2^-9 per value; int8 ~1/254 of each block's max; PowerSGD from a
# random start at one step is a coarse projection (error feedback pays it back later, see
# tests/unit/test_kernels_codecs.py), rank 8 tighter than rank 2.
TOLERANCE = {
    "none": 1e-6,
    "bf16": 0.01,
    "int8": 0.02,
    "int8:64": 0.01,
    "lowrank:2": 0.6,
    "lowrank:8": 0.35,
    # bf16 factors: the same projection, plus bf16 rounding of P and Q (~2^-9 per value)
    "lowrank-bf16:4": 0.45,
    "lowrank-bf16:8": 0.35,
    # one step, no residual yet: what the largest tenth / half of each bucket leaves out
    "topk:0.1": 0.3,
    "topk:0.5": 0.05,
    "topk:1.0": 1e-6,  # every entry sent in float32: the plain sum
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_hook_matches_plain_allreduce_within_codec_tolerance(world: int, tmp_path: Path) -> None:
    result = _run("compare", world, tmp_path, timeout_s=230)
    for level, tol in TOLERANCE.items():
        assert result[level]["rel_l2_err"] <= tol, (level, result[level])
    assert result["none"]["max_abs_diff"] < 1e-6
    assert result["lowrank:8"]["rel_l2_err"] < result["lowrank:2"]["rel_l2_err"]
    assert result["topk:0.5"]["rel_l2_err"] < result["topk:0.1"]["rel_l2_err"]
    # one step from the same random Q: bf16 factors land within rounding of float32 ones
    assert result["lowrank-bf16:8"]["rel_l2_err"] <= result["lowrank:8"]["rel_l2_err"] + 0.005
    # The norm of the gradient each level really applied, and the variance from the ranks'
    # gradients, against float64 sums of the same tensors: the hook takes float32 dot
    # products (kernels/stats.py), so they agree to float32 accumulation, not to 1e-9.
    for level, r in result.items():
        assert math.isclose(r["grad_norm"], r["applied_norm"], rel_tol=1e-5), (level, r)
    for level in ("none", "bf16", "int8"):
        r = result[level]
        assert math.isclose(r["grad_variance"], r["expected_variance"], rel_tol=1e-4), (level, r)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shares_give_the_full_batch_gradient(world: int, tmp_path: Path) -> None:
    result = _run("shares", world, tmp_path, timeout_s=230)
    print(f"W={world}: max |hook - full batch| = {result['max_abs_diff']:.3g}")
    assert result["max_abs_diff"] < 1e-6
    # and the weighting is what made it so: plain averaging is visibly off
    assert result["plain_ddp_max_abs_diff"] > 100 * max(result["max_abs_diff"], 1e-9)


@pytest.mark.timeout(240)
def test_level_switches_mid_run_keep_training(tmp_path: Path) -> None:
    result = _run("switch", 2, tmp_path, timeout_s=230)
    levels = result["levels"]
    expected = ["none"] * 8 + ["int8"] * 8 + ["lowrank:2"] * 8 + ["bf16"] * 8 + ["int8:64"] * 8
    assert levels == expected + ["topk:0.1"] * 8 + ["none"] * 8
    assert result["param_max_rank_diff"] == 0.0  # every rank applied the same update
    losses = result["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0  # still learning throughout
    for stat in result["stats"]:
        _step, grad_norm, _variance, _noise, comm_bytes, allreduce_s = stat
        assert grad_norm > 0 and comm_bytes > 0 and allreduce_s > 0
    assert [s[0] for s in result["stats"]] == list(range(56))
    by_level = {lv: s[4] for s, lv in zip(result["stats"], levels, strict=True)}
    assert by_level["int8"] < by_level["bf16"] < by_level["none"]
    assert by_level["lowrank:2"] < by_level["int8"]
    assert by_level["topk:0.1"] < by_level["int8"]  # 2 x 0.1 of float32 against 25.4%
    # variance across ranks and the noise scale are estimated on (nearly) every step
    assert sum(s[2] is not None for s in result["stats"]) == 56
    assert sum(s[3] is not None and s[3] > 0 for s in result["stats"]) >= 46
    assert result["summaries"] == [[True, True]] * 56  # step_summary: once per step
    *errors, built = result["errors"]
    assert all("\n" not in m and m != "no error" for m in errors)
    assert "unknown compression level 'int4'" in errors[0]
    assert "cannot switch level at step -1" in errors[1]
    assert "unknown compression level 'fp8'" in errors[2]
    assert built == "from_config level int8:64"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_counted_bytes_equal_bytes_sent(world: int, tmp_path: Path) -> None:
    result = _run("bytes", world, tmp_path, timeout_s=230)
    for level, r in result.items():
        # The count equals an independent computation from the bucket sizes ...
        assert r["comm_bytes"] == r["expected"], level
        # ... and the tensors really passed to the collectives, under the ring model.
        total = 0
        for op, _dtype, payload, sent in r["records"]:
            model = (
                2 * (world - 1) * payload // world if op == "all_reduce" else (world - 1) * payload
            )
            assert sent == model
            total += sent
        assert total == r["comm_bytes"]
    # At `none` the statistics ride in the last bucket's all-reduce: one collective a bucket.
    assert len(result["none"]["records"]) == len(result["none"]["buckets"])
    assert len(result["bf16"]["records"]) == len(result["bf16"]["buckets"]) + 1
    numel = sum(n for n, _ in result["none"]["buckets"])
    int8_payload = sum(p for op, _, p, _ in result["int8"]["records"] if op == "all_gather")
    assert int8_payload == numel + 4 * sum(-(-n // 256) for n, _ in result["int8"]["buckets"])
    assert all(d == "torch.bfloat16" for _, d, _, _ in result["bf16"]["records"][:-1])
    factor_dtypes = {d for _, d, _, _ in result["lowrank-bf16:4"]["records"][:-1]}
    assert factor_dtypes == {"torch.float32", "torch.bfloat16"}  # exact spans, factors
    topk = [p for op, _, p, _ in result["topk:0.01"]["records"] if op == "all_gather"]
    assert topk == [8 * -(-n // 100) for n, _ in result["topk:0.01"]["buckets"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_lowrank_warmup_keeps_ranks_in_step_and_counts_bytes(world: int, tmp_path: Path) -> None:
    result = _run("warmup", world, tmp_path, timeout_s=230)
    assert result["ops"] == [["all_gather"]] * 3 + [["all_reduce"]] * 5  # int8, then PowerSGD
    assert result["counted"] == result["expected"]  # every step, both phases
    assert result["param_max_rank_diff"] == 0.0
    assert all(math.isfinite(x) for x in result["losses"])


@pytest.mark.timeout(120)
def test_a_step_of_several_synchronised_passes_counts_every_pass_s_bytes(tmp_path: Path) -> None:
    """Accumulation without `no_sync` all-reduces at every micro-batch: the step row's bytes
    were the last pass's alone (a third of what crossed, here)."""
    (one, three) = _run("accumulate", 2, tmp_path, 100)["summaries"]
    step_bytes, step_s, last_bytes, last_s = one
    assert step_bytes == last_bytes > 0 and step_s == last_s
    step_bytes, step_s, last_bytes, last_s = three
    assert last_bytes == one[2] and step_bytes == 3 * last_bytes
    assert step_s > last_s > 0


@pytest.mark.timeout(240)
def test_a_late_read_takes_each_backwards_own_loss_scale(tmp_path: Path) -> None:
    result = _run("late_scale", 2, tmp_path, timeout_s=230)
    assert len(result["landed"]) == 2 and all(t > 0 for t in result["landed"])
    for now, late in zip(result["landed"], result["late"], strict=True):
        assert math.isclose(now, late, rel_tol=1e-9), result
