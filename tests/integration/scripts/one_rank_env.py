"""The reference training script with variables set on one rank only:
TEST_ONE_RANK_ENV="RANK:NAME=VALUE[;RANK:NAME=VALUE...]" (per-rank mistakes torchrun's
environment cannot stage)."""

import os
import runpy
import sys
from pathlib import Path

for item in filter(None, os.environ.get("TEST_ONE_RANK_ENV", "").split(";")):
    rank, _, assignment = item.partition(":")
    if os.environ.get("RANK") == rank:
        name, _, value = assignment.partition("=")
        os.environ[name] = value
script = Path(__file__).resolve().parents[3] / "src" / "trainspec" / "workload" / "train_gpt.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
