"""The hook on DDP models of sub-groups (pipeline plus data parallelism): four ranks in two
data-parallel groups, {0, 1} and {2, 3}, each training its own model, with
`CompressionHook(level).register(ddp)` and no group given to the hook. It summed over the
whole world: every rank's gradient was the mean of all four ranks', both groups' models
together (max error 0.85 at `none`), silently. With `find_unused_parameters` its own group
must be made by DDP's ranks alone (the other group's ranks are making theirs at that
moment): a world-synchronised `new_group` crashed the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "subgroup_ddp.py"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("level", "unused", "tolerance"),
    [("none", False, 1e-6), ("int8", True, 0.02)],  # int8: block-scaled, 1/254 of a block's max
)
def test_the_hook_sums_over_ddps_sub_group(
    tmp_path: Path, level: str, unused: bool, tolerance: float
) -> None:
    out = tmp_path / "out"
    torchrun(tmp_path, f"subgroups-{level}", script=SCRIPT, ranks=4, timeout_s=150,
             script_args=[str(out), level, *(["unused"] if unused else [])])  # fmt: skip
    for rank in (0, 2):
        report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert report["hook_world"] == 2
        assert report["own_group"] is unused
        assert report["worst_abs_diff"] <= tolerance, report


@pytest.mark.timeout(200)
def test_ranks_in_different_numbers_of_groups_are_refused_in_one_line(tmp_path: Path) -> None:
    """torch names a group made by DDP's ranks alone from their ranks and how many groups
    each is in: with the groups' leaders in one more group, each rank waited for its peer
    under another name until the timeout (review). Now every rank refuses alike, at once."""
    out = tmp_path / "out"
    torchrun(tmp_path, "subgroups-leaders", script=SCRIPT, ranks=4, timeout_s=150,
             script_args=[str(out), "int8", "unused", "leaders"])  # fmt: skip
    for rank in (0, 2):
        report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert "different numbers of process groups" in report["error"]
        assert "CompressionHook(level, group=...)" in report["error"]
