"""A rank in a shadow pass of DDP's `join()` adds exactly nothing to the sum, at every level,
and keeps its error feedback for later; the ranks that trained the step get the whole
error-feedback credit (lowrank: 1 / (W - k) each with k ranks in shadow passes).

Before (QA 2026-11-28): a shadow pass's zero gradient went through the codec with the rank's
error-feedback residual, so the joined rank added its residual (or topk's or lowrank's
approximation of it) to the sum of a step it did not train, and spent it; lowrank credited
each rank that trained with 1 / W of the low-rank sum. Relative L2 error of each join
step's gradient against the same step on the ranks that trained it alone, in this test's
job (2 ranks: steps 2-3; 3 ranks: steps 2-4): int8 1.3e-2, 5e-5 / 7.4e-3, 4e-5, 1.8e-2;
topk:0.25 0.26, 0.16 / 0.24, 0.17, 0.60; lowrank:2 0.55, 0.85 / 0.46, 0.65, 1.09, and the
residuals of the ranks that trained 0.5-3.0 off at lowrank (the credit alone: 0.2-2.1);
`none` was exact, as it keeps no residual. Now 0 at every level.

scripts/join_exact_worker.py replays each join step's exchanges through copies of the codec
on a group of the ranks that trained it alone; the gradient DDP handed back and their
residuals must equal that bitwise (every value the sums are built from is then the same:
adding a rank's exact 0.0 changes no float but the sign of a zero, which `torch.equal`
does not tell), and the joined rank's residuals must be unchanged across its shadow passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "join_exact_worker.py"
LEVELS = ["none", "int8", "topk:0.25", "lowrank:2"]
STEPS = {2: (4, 2), 3: (5, 4, 2)}  # as in the worker: steps each rank trains


def _run(tmp_path: Path, world: int) -> dict[int, dict]:
    env = {"TRAINSPEC_ACTUATOR": "off", "TRAINSPEC_COLLECTOR_PROBE": "0"}
    torchrun(tmp_path, f"join-exact-{world}", script=SCRIPT, ranks=world, env=env,
             script_args=[str(tmp_path), *LEVELS], timeout_s=200)  # fmt: skip
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.mark.timeout(260)
@pytest.mark.parametrize("world", [2, 3])
def test_a_shadow_pass_adds_nothing_and_keeps_its_error_feedback(
    tmp_path: Path, world: int
) -> None:
    ranks = _run(tmp_path, world)
    steps = STEPS[world]
    failures = []
    for index, level in enumerate(LEVELS):
        for rank, report in ranks.items():
            got = report["levels"][index]
            assert got["level"] == level
            # every step some rank sat out that this rank trained was checked
            join_steps = [s for s in range(min(steps), steps[rank])]
            assert [s["step"] for s in got["join_steps"]] == join_steps, (level, rank)
            for s in got["join_steps"]:
                assert s["buckets"] >= 2, s  # several buckets: the chain and the carrier
                if not (s["grad_equal"] and s["residual_equal"]):
                    failures.append((level, rank, s))
            if got["shadow_passes"]:
                if level != "none":  # a residual to keep: the check can fail
                    assert got["held_nonzero"] > 0, (level, rank, got)
                if got["residual_changed"] or got["pieces_after"] != got["held_pieces"]:
                    failures.append((level, rank, "residual spent in shadow passes", got))
    assert not failures, failures
