"""Kill, preempt and damage a two-rank torchrun job; it must resume with nothing lost or repeated."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from recovery_logs import (  # noqa: E402
    child_env,
    committed_steps,
    global_losses,
    read_attempts,
    run_job,
    sample_multiset,
    torchrun_command,
)

pytestmark = pytest.mark.integration
STEPS = 30
COMMON = ("--steps", str(STEPS), "--ckpt-every", "5", "--shares-at", "7:10,6")


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    _ok(run_job(out / "out", out / "ckpt", *COMMON))
    return out / "out"


def _assert_same_run(out: Path, reference: Path) -> None:
    """Committed steps equal the uninterrupted run's, step by step and rank by rank."""
    got, want = committed_steps(read_attempts(out)), committed_steps(read_attempts(reference))
    assert sorted(got) == list(range(1, STEPS + 1)), "a step is missing from the committed record"
    for step in want:
        for rank in want[step]:
            assert got[step][rank]["indices"] == want[step][rank]["indices"], (
                f"data order differs at step {step}"
            )
    assert sample_multiset(got) == sample_multiset(want)
    ref_loss, loss = global_losses(want), global_losses(got)
    for step in want:  # the loss curve continues exactly where the checkpoint left it
        assert loss[step] == pytest.approx(ref_loss[step], rel=1e-6, abs=1e-6)
    final, ref_final = torch.load(out / "final.pt"), torch.load(reference / "final.pt")
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), f"final parameter {name} differs"


def _resume_step(out: Path, attempt: int = 1) -> int:
    return read_attempts(out)[attempt].resume_step


@pytest.mark.timeout(300)
def test_sigkill_one_rank_resumes_with_nothing_lost(tmp_path: Path, reference: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(6, STEPS - 2)
    env = {"TRAINSPEC_INJECT": f"kill:rank={rank},step={step}", "TRAINSPEC_ALLOW_INJECT": "1"}
    proc = run_job(tmp_path / "out", tmp_path / "ckpt", *COMMON, env=env, max_restarts=1)
    _ok(proc)
    attempts = read_attempts(tmp_path / "out")
    assert len(attempts) == 2, (
        f"expected one restart (kill rank {rank} at step {step}, seed {seed})"
    )
    assert attempts[0].first("kill", rank)["step"] == step
    assert 0 <= attempts[1].resume_step < step
    _assert_same_run(tmp_path / "out", reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 1])
def test_kill_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, reference: Path, rank: int
) -> None:
    proc = run_job(
        tmp_path / "out",
        tmp_path / "ckpt",
        *COMMON,
        "--kill-during-save",
        f"{rank}:15",
        max_restarts=1,
    )
    _ok(proc)
    # save(15) waits for save(10) to commit first, so 10 is the newest committed checkpoint.
    assert _resume_step(tmp_path / "out") == 10
    _assert_same_run(tmp_path / "out", reference)


@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_before_exit_and_the_job_resumes(
    tmp_path: Path, reference: Path
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = torchrun_command(out, ckpt, *COMMON, "--step-sleep", "0.15")
    launcher = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            attempts = read_attempts(out) if out.exists() else []
            if attempts and len(attempts[0].steps(0)) >= 8:
                break
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)  # what a scheduler does before preempting the node
        launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    preempted = [read_attempts(out)[0].first("preempted", r) for r in (0, 1)]
    assert all(p is not None and p["committed"] for p in preempted), preempted
    stopped_at = preempted[0]["step"]
    assert preempted[1]["step"] == stopped_at and stopped_at >= 8
    _ok(run_job(tmp_path / "out2", ckpt, *COMMON))
    assert _resume_step(tmp_path / "out2", attempt=0) == stopped_at
    # The two runs together are the uninterrupted run.
    for path in (tmp_path / "out2").glob("steps_r*_a0.jsonl"):
        path.rename(out / path.name.replace("_a0", "_a1"))
    (tmp_path / "out2" / "final.pt").rename(out / "final.pt")
    _assert_same_run(out, reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_damaged_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, reference: Path, damage: str
) -> None:
    ckpt = tmp_path / "ckpt"
    _ok(run_job(tmp_path / "out", ckpt, *COMMON[2:], "--steps", "12"))
    newest = sorted(ckpt.glob("step_000000010_*"))[0]
    shard = sorted(newest.glob("*.distcp"))[-1]
    if damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    _ok(run_job(tmp_path / "out2", ckpt, *COMMON))
    resume = read_attempts(tmp_path / "out2")[0].first("resume")
    assert resume["step"] == 5 and len(resume["fallbacks"]) == 1
    assert ("does not match its manifest" if damage == "corrupt" else "missing file") in resume[
        "fallbacks"
    ][0]
    final, ref_final = (
        torch.load(tmp_path / "out2" / "final.pt"),
        torch.load(reference / "final.pt"),
    )
    assert all(torch.equal(final[k], v) for k, v in ref_final.items())


@pytest.mark.timeout(300)
def test_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _ok(run_job(tmp_path / "out", ckpt, "--steps", "6", "--ckpt-every", "5"))
    proc = run_job(tmp_path / "out2", ckpt, "--steps", "8", nproc=1)
    assert proc.returncode != 0
    assert "written by 2 ranks, this job has 1" in proc.stderr
