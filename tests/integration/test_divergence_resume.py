"""A job that diverges (NaN weights) keeps its last good checkpoint, and a resume loads it
(QA B1: the anomaly checkpoints of the diverged state rotated every good one out, and the
resumed job was NaN from its first step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parent / "scripts" / "diverge_train.py"
SMALL = ["--max-bytes=300000", "--layers=1", "--embd=64", "--batch-size=8", "--global-batch=16"]
ENV = {"TRAINSPEC_ACTUATOR_WINDOW_STEPS": "5", "TRAINSPEC_ACTUATOR_COMPRESSION": "0",
       "TRAINSPEC_ACTUATOR_REBALANCE": "0", "TRAINSPEC_CHECKPOINT_KEEP_LAST": "3"}  # fmt: skip


def _losses(root: Path, run: str) -> dict[int, float | None]:
    rows = store.open(root / run).execute("SELECT step, loss FROM steps WHERE rank = 0")
    return dict(rows.fetchall())


@pytest.mark.timeout(400)
def test_a_resume_after_divergence_loads_the_last_finite_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    torchrun(tmp_path, "div", env=ENV, script=SCRIPT, timeout_s=180,
             script_args=[*SMALL, "--steps=36", f"--ckpt-dir={ckpt}"])  # fmt: skip
    diverged = _losses(tmp_path, "div")
    assert all(diverged[s] is None for s in range(20, 36)), diverged  # NaN: not stored
    manifests = {c.step: json.loads(c.commit_path.read_text())
                 for c in committed_newest_first(ckpt)}  # fmt: skip
    marks = {step: (m.get("finite"), m.get("anomaly")) for step, m in manifests.items()}
    assert marks.get(6) == (True, None), marks  # the last checkpoint before the trouble
    assert sum(1 for finite, _ in marks.values() if not finite) <= 1, marks
    assert all(s <= 16 for s in marks), marks  # none taken while the loss was NaN

    torchrun(tmp_path, "res", env=ENV, timeout_s=180,
             script_args=[*SMALL, "--steps=16", f"--ckpt-dir={ckpt}"])  # fmt: skip
    con = store.open(tmp_path / "res")
    (resumed,) = con.execute(
        "SELECT json_extract(evidence, '$.step') FROM events WHERE name = 'resumed' AND rank = 0"
    ).fetchone()
    assert int(resumed) == 6
    losses = _losses(tmp_path, "res")
    assert sorted(losses) == list(range(6, 16))
    assert all(v is not None and math.isfinite(v) for v in losses.values()), losses
