"""A two-rank job (torchrun, gloo) restarted in the middle of a loss spike keeps the checkpoint
from before the spike under `keep_last=1`. Before, the restarted job measured its loss
reference afresh at the high loss, saw no spike, marked its first save as taken in no
anomaly, and retention deleted the last checkpoint from before the trouble (QA: a run with
`keep_last=1` kept only one, at 2-5x the pre-spike loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first, marks

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_rollback.py"
SPIKE_AT = 10  # the script's: the first step whose reported loss is 10x
ENV = {
    "TRAINSPEC_ACTUATOR_WINDOW_STEPS": "2",
    "TRAINSPEC_ACTUATOR_COMPRESSION": "0",
    "TRAINSPEC_ACTUATOR_REBALANCE": "0",
    "TRAINSPEC_ACTUATOR_MEMORY": "0",
    "TRAINSPEC_COLLECTOR_PROBE": "0",
    "TRAINSPEC_CHECKPOINT_KEEP_LAST": "1",
    # Young/Daly's interval is then one step: every window that knows the cost saves
    "TRAINSPEC_CHECKPOINT_MTBF_GPU_HOURS": "1e-9",
}


def _kept(ckpt: Path) -> list[tuple[int, str | None]]:
    """(step, anomaly) of each committed checkpoint, newest first; each finite."""
    found = [(c.step, *marks(c)) for c in committed_newest_first(ckpt)]
    assert all(finite for _, finite, _ in found), found
    return [(step, anomaly) for step, _, anomaly in found]


@pytest.mark.timeout(400)
def test_a_restart_in_a_loss_spike_keeps_the_checkpoint_from_before_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [str(tmp_path), str(ckpt)]
    torchrun(tmp_path / "runs", "first", script=SCRIPT, env=ENV,
             script_args=[*args, "first"], timeout_s=200)  # fmt: skip
    before = _kept(ckpt)
    assert len(before) == 2, before  # keep_last=1, and the newest taken before the spike
    (newest, anomaly), (clean, none) = before
    assert anomaly is not None and anomaly.startswith("loss spike since step "), before
    began = int(anomaly.rsplit(" ", 1)[1])
    assert none is None and clean <= SPIKE_AT + 1 < began <= newest, before

    torchrun(tmp_path / "runs", "resume", script=SCRIPT, env=ENV,
             script_args=[*args, "resume"], timeout_s=200)  # fmt: skip
    for rank in (0, 1):
        report = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        assert report["first_step"] == newest
    after = _kept(ckpt)
    # The restarted job saved (a step of its own), marked with the first job's episode, and
    # the checkpoint from before the spike is still there.
    assert after[0][0] > newest and after[0][1] == anomaly, after
    assert after[-1] == (clean, None) and len(after) == 2, after

    con = store.open(tmp_path / "runs" / "resume")
    rows = con.execute(
        "SELECT rank, evidence FROM events WHERE name = 'resumed' ORDER BY rank"
    ).fetchall()
    assert [r for r, _ in rows] == [0, 1]
    for _, evidence in rows:
        episode = json.loads(evidence)["actuator"]["episode"]
        assert episode["restored"] == ["loss", "checkpoint"] and episode["anomaly"] == anomaly
