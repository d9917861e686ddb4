"""A checkpoint that one rank cannot prepare fails on every rank at once, and the next one
commits: no rank waits out a collective timeout, none commits a directory missing a part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun
from trainspec.runtime.checkpoint_layout import committed_newest_first

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_vote.py"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_failure_on_one_rank_fails_the_save_on_all(tmp_path: Path, mode: str) -> None:
    torchrun(tmp_path, f"vote-{mode}", script=SCRIPT, script_args=[str(tmp_path), mode],
             timeout_s=200)  # fmt: skip
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        first, second, third = report["saves"]
        assert first["record"] and third["record"], (rank, report)
        assert not second["record"] and second["reasons"] == ["save_failed"], (rank, report)
        # Well under the 60 s collective timeout the script sets: the vote, not a timeout.
        assert second["seconds"] < 30, (rank, second)
        assert report["loaded_step"] == 3
    assert [c.step for c in committed_newest_first(tmp_path / "ckpt")] == [3, 1]
