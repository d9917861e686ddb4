"""The reference job resumes after a rank is killed: `torchrun --max-restarts 1` restarts the
ranks, `act.resume()` loads the newest committed checkpoint (model, optimizer, the sampler's
position) and the loop continues from its step. The restart ran every step again from 0
with a fresh model, and the actuator's async checkpoints stopped after the first (its cost
never reached the policy), and no save was stored as an event. The killed rank's unflushed
rows are stored from its journal when it restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainspec.store as store
from tests.integration.jobs import free_port

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.mark.timeout(300)
def test_the_reference_job_resumes_from_its_checkpoint_after_a_kill(tmp_path: Path) -> None:
    env = dict(os.environ, TRAINSPEC_STORE_ROOT=str(tmp_path / "runs"), OMP_NUM_THREADS="1",
               TRAINSPEC_STORE_RUN_ID="resume", TRAINSPEC_ALLOW_INJECT="1",
               TRAINSPEC_INJECT="kill:rank=1,step=24", TRAINSPEC_CHECKPOINT_MTBF_GPU_HOURS="0.001",
               TRAINSPEC_COLLECTOR_PROBE="0",
               # No flush before the kill: what rank 1's first attempt stored came from the
               # journal, salvaged by its restart.
               TRAINSPEC_STORE_FLUSH_INTERVAL_S="600")  # fmt: skip
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(EXAMPLE),
           "--steps", "40", "--batch-size", "8", "--layers", "1", "--embd", "32",
           "--block-size", "32", "--max-bytes", "40000", "--ckpt-dir", str(tmp_path / "ck")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    con = store.open(tmp_path / "runs" / "resume")
    resumed = con.execute(
        "SELECT rank, json_extract(evidence, '$.step')::INT FROM events WHERE name = 'resumed' "
        "ORDER BY rank"
    ).fetchall()
    assert [r for r, _ in resumed] == [0, 1], resumed
    start = resumed[0][1]
    assert 0 < start < 24 and resumed[1][1] == start  # both from the same checkpoint
    # Rank 1 died at step 24: its first attempt stored steps up to then at most, and the
    # second began at the checkpoint's step, not at 0.
    steps = con.execute("SELECT step FROM steps WHERE rank = 1 ORDER BY ts").fetchall()
    second = [s for (s,) in steps][-(40 - start) :]
    assert second == list(range(start, 40))
    # The killed attempt's steps, up to its last sampling tick (50 ms) before the kill, are
    # stored, though it never flushed (none without the journal).
    first = [s for (s,) in steps][: -(40 - start)]
    assert first == list(range(len(first))) and len(first) >= 12, first
    saved = con.execute("SELECT count(*) FROM events WHERE name = 'saved'").fetchone()[0]
    assert saved >= 2  # saves are stored as events, the async ones included
    # The actuator's own state came back with the checkpoint, on both ranks (details:
    # test_actuator_state_resume.py).
    restored = con.execute(
        "SELECT json_extract_string(evidence, '$.actuator.restored'), "
        "json_extract_string(evidence, '$.actuator.micro_batch.restored') "
        "FROM events WHERE name = 'resumed' ORDER BY rank"
    ).fetchall()
    assert restored == [("true", "true")] * 2, restored
    # Each process is judged on its own: the restart (rank 1 dead, then importing: 5-10 s
    # here) is no series' gap, and the counters that started again from 0 are resets.
    from trainspec.schema.catalogue import load_catalogue
    from trainspec.store.compliance import validate_target
    from trainspec.store.target import read_run

    data = read_run(tmp_path / "runs" / "resume", load_catalogue())
    gaps = {s.metric: s.max_gap_s for s in data.series if s.rank == 1 and s.max_gap_s}
    assert gaps and max(gaps.values()) < 3.0, gaps
    report = validate_target(str(tmp_path / "runs" / "resume"))
    assert not [v for v in report.violations if v.rule == "monotonic"], report.violations
