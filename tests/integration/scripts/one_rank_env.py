"""The reference training script with one variable set on one rank only:
TEST_ONE_RANK_ENV="RANK:NAME=VALUE" (a per-rank mistake torchrun's environment cannot stage)."""

import os
import runpy
import sys
from pathlib import Path

rank, _, assignment = os.environ.get("TEST_ONE_RANK_ENV", "").partition(":")
if rank and os.environ.get("RANK") == rank:
    name, _, value = assignment.partition("=")
    os.environ[name] = value
script = Path(__file__).resolve().parents[3] / "src" / "trainspec" / "workload" / "train_gpt.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
