"""The reference workload (train_gpt.py) whose AdamW learning rate jumps to 1e4 at its 13th
optimizer step: a real divergence, NaN weights from about step 15 (QA B1's scenario)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[3] / "src" / "trainspec" / "workload" / "train_gpt.py"

_AdamW = torch.optim.AdamW


class DivergingAdamW(_AdamW):
    def step(self, closure=None):  # type: ignore[override]
        self._steps = getattr(self, "_steps", 0) + 1
        if self._steps == 13:
            for group in self.param_groups:
                group["lr"] = 1e4
        return super().step(closure)


torch.optim.AdamW = DivergingAdamW  # type: ignore[misc]
sys.argv[0] = str(SCRIPT)
runpy.run_path(str(SCRIPT), run_name="__main__")
