"""The hook's noise-scale EMA under a GradScaler whose scale changes: it smooths the two
terms in the gradient's own units. Read at the loss scale, a step's terms carry s^2, so a
step before the scale doubled weighed a quarter of one after it in the EMA."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "noise_scale_under_scaler.py"


@pytest.mark.timeout(150)
def test_the_noise_scale_does_not_depend_on_the_loss_scale(tmp_path: Path) -> None:
    out = tmp_path / "noise.json"
    torchrun(tmp_path, "noise-scale", script=SCRIPT, script_args=[str(out)], timeout_s=120)
    noise = json.loads(out.read_text())
    assert noise["scales"][-1] > noise["scales"][0]  # the scale moved at every step
    plain, scaled = noise["plain"], noise["scaled"]
    assert all(v is not None for v in plain), plain
    for a, b in zip(plain, scaled):
        assert math.isclose(a, b, rel_tol=1e-5), (plain, scaled)
