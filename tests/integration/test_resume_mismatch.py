"""Resuming the reference job with another global batch, seed or model: one line per rank,
exit 2, and the checkpoints left as they were.

Another global batch raised a raw SamplerStateError traceback from every rank, after model
and optimizer had been loaded; another model printed dcp's remote tracebacks, cut before
their cause, once per checkpoint (117 lines; QA sweep of the actuator).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import free_port
from trainspec.runtime.checkpoint_layout import committed_newest_first

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
SMALL = ["--batch-size", "8", "--layers", "1", "--block-size", "32", "--max-bytes", "40000"]


def _job(tmp: Path, ckpt: Path, run_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TRAINSPEC_STORE_ROOT=str(tmp / "runs"), TRAINSPEC_STORE_RUN_ID=run_id,
               OMP_NUM_THREADS="1", TRAINSPEC_COLLECTOR_PROBE="0")  # fmt: skip
    env = {k: v for k, v in env.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(EXAMPLE), *SMALL,
           "--ckpt-dir", str(ckpt), *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("mismatch")
    proc = _job(tmp, tmp / "ck", "first", "--steps", "12", "--embd", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert committed_newest_first(tmp / "ck"), proc.stderr[-3000:]
    return tmp / "ck"


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--embd", "32", "--global-batch", "8"], "global_batch=16"),
        (["--embd", "32", "--seed", "3"], "seed=0"),
        (["--embd", "64"], "Size mismatch"),
    ],
)
def test_a_resume_that_does_not_fit_is_one_line_per_rank_and_exit_2(
    tmp_path: Path, checkpoints: Path, args: list[str], words: str
) -> None:
    before = sorted(p.name for p in checkpoints.iterdir())
    proc = _job(tmp_path, checkpoints, "again", "--steps", "14", *args)
    assert proc.returncode != 0, proc.stderr[-3000:]
    # No rank's traceback (torchrun's own, for the failed child, stays) and no remote one:
    err = proc.stderr
    assert 'train_gpt.py", line' not in err and "(RANK 0)" not in err, err[-3000:]
    assert "SamplerStateError" not in err and "trainspec/runtime" not in err, err[-3000:]
    # One line per rank (two ranks' prints may share a line of the pipe: counted, not split)
    assert err.count("train_gpt.py: ") == 2 and err.count(words) >= 2, err[-3000:]
    warned = err.count("trying an older checkpoint")
    assert warned <= len(before), err[-3000:]  # one line per checkpoint at most
    assert sorted(p.name for p in checkpoints.iterdir()) == before  # nothing set aside
