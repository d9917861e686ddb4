"""A preemption notice (SIGTERM) in the reference job: checkpoint at the next step boundary,
on every rank alike, then a clean stop with everything measured flushed."""

from __future__ import annotations

import pytest

import trainspec.store as store
from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_then_stops_cleanly(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"TRAINSPEC_ALLOW_INJECT": "1", "TRAINSPEC_INJECT": "preempt:step=12"}
    torchrun(
        tmp_path, "pre", env=env, script_args=["--steps=60", "--batch-size=8", f"--ckpt-dir={ckpt}"]
    )
    con = store.open(tmp_path / "pre")
    last_steps = con.execute(
        "SELECT rank, max(step) FROM steps GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert all(12 <= s < 59 for _, s in last_steps), last_steps  # stopped early, both ranks
    events = con.execute(
        "SELECT DISTINCT rank FROM events WHERE kind = 'action' AND reason LIKE 'preemption%'"
    ).fetchall()
    assert sorted(r for (r,) in events) == [0, 1]
    newest = committed_newest_first(ckpt)
    assert newest, "no committed checkpoint after the preemption notice"
