"""Error feedback keeps the running sum of applied updates unbiased across steps, through
DDP's bucket rebuild after step 0, which reorders the parameters inside a bucket of the same
size: residuals laid back by bucket index alone landed on other parameters (relative error
2.5e-3 at int8, 0.15 at lowrank:1 after 10 steps; 1e-7 at none). On a model the rebuilt
buckets split (step 0 runs in DDP's one initial bucket), step 0's residual matched no rebuilt
bucket and was dropped (1.2e-3 at int8, 0.10 at lowrank:1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "error_feedback_sum.py"


def _run(tmp_path: Path, level: str, model: str) -> dict:
    out = tmp_path / "rank0.json"
    env = {"TRAINSPEC_ACTUATOR": "off", "TRAINSPEC_COLLECTOR_PROBE": "0"}
    torchrun(tmp_path, f"ef-{model}-{level.replace(':', '-')}", script=SCRIPT, env=env,
             script_args=[str(out), level, model], timeout_s=150)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["level"] == level
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", ["int8", "lowrank:1"])
def test_applied_plus_held_residuals_sum_to_the_true_gradient(tmp_path: Path, level: str) -> None:
    report = _run(tmp_path, level, "three")
    assert report["error"] < 1e-5, report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", ["int8", "lowrank:1"])
def test_the_sum_holds_when_the_rebuild_splits_the_initial_bucket(
    tmp_path: Path, level: str
) -> None:
    report = _run(tmp_path, level, "buckets")
    assert report["buckets"] >= 2, report  # the rebuilt layout is several buckets
    assert report["error"] < 1e-5, report
