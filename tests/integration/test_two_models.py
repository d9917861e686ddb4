"""Two DDP models under one session (a GAN's or an actor-critic's layout), two gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "two_models_check.py"


@pytest.mark.timeout(120)
def test_two_models_share_weights_levels_and_one_step_of_statistics(tmp_path):
    out = tmp_path / "two-r{rank}.json"
    env = {"TRAINSPEC_ACTUATOR_ENABLED": "0"}
    torchrun(tmp_path, "two", env=env, script=SCRIPT, script_args=[str(out)], timeout_s=100)
    results = [json.loads(Path(str(out).replace("{rank}", str(r))).read_text()) for r in (0, 1)]
    for r in results:
        # Uneven shares reached both models: each one's update is its full-batch gradient.
        assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), r
        # A switch asked of the session reached both models' hooks at the next step.
        assert r["levels_after"] == ["int8", "int8"]
        assert r["hooks"] == "HookSet"
        # Wrapped after actuate(): the actuated shares and level, not equal shares of 1/W.
        assert r["late_shares"] == [[4, 8], [4, 8]] and r["late_level"] == "int8"
    con = store.open(tmp_path / "two")
    rows = con.execute(
        "SELECT rank, step, grad_norm, grad_variance, compression, grad_noise_scale FROM steps "
        "ORDER BY step, rank"
    ).fetchall()
    assert [(rank, step) for rank, step, *_ in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for rank, step, norm, variance, compression, noise in rows:
        if step == 1:  # both models' smoothed terms, combined when the row was made
            assert results[rank]["noise_step1"] is not None
            assert noise == pytest.approx(results[rank]["noise_step1"], rel=1e-9)
        if step == 0:  # the norm over both models' reduced gradients, once per step
            assert norm == pytest.approx(results[rank]["norm_step0"], rel=1e-5)
            assert variance is not None
        assert compression == ("none" if step == 0 else "int8")
