"""DDP models the gradient hook must not break. One built with `find_unused_parameters`
trains at the multi-round levels: their later rounds, launched from future callbacks, no
longer share a group with DDP's own all-reduce of the used-parameter map (gloo aborted the
job at step 3, 4 of 4 runs at int8). One with sparse gradients trains on DDP's own
all-reduce (the hook raised on the sparse bucket)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "unused_params.py"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", ["int8", "lowrank:2"])
def test_multi_round_levels_train_with_unused_parameters(tmp_path: Path, level: str) -> None:
    out = tmp_path / "rank0.json"
    torchrun(tmp_path, f"unused-{level.replace(':', '-')}", script=SCRIPT,
             script_args=[str(out), level], timeout_s=150)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["level"] == level
    assert len(report["losses"]) == 30 and all(math.isfinite(v) for v in report["losses"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", ["int8", "topk:0.1"])
def test_the_hook_registered_by_hand_gets_its_own_group_next_to_unused_parameters(
    tmp_path: Path, level: str
) -> None:
    """`CompressionHook(level).register(ddp)` on DDP's own group, without a session: both
    ranks waited out the group's timeout at step 3 (QA, 2026-11-27); `register` now gives
    the hook a group of its own there, as `trainspec.wrap` did."""
    out = tmp_path / "rank0.json"
    torchrun(tmp_path, f"direct-{level.replace(':', '-')}", script=SCRIPT,
             script_args=[str(out), level, "direct"], timeout_s=150)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["own_group"] is True
    assert len(report["losses"]) == 30 and all(math.isfinite(v) for v in report["losses"])


@pytest.mark.timeout(200)
def test_a_model_with_sparse_gradients_trains_on_ddps_own_all_reduce(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    proc = torchrun(tmp_path, "sparse", script=Path(__file__).parent / "scripts" / "sparse_embedding.py",
                    script_args=[str(out)], timeout_s=150)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["hook"] is False and len(report["losses"]) == 5
    assert "makes sparse gradients" in proc.stderr + proc.stdout
