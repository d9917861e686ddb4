"""Reading what `recovery_train.py` logged: attempts, committed steps, timings.

A step counts as committed when no later attempt recomputed it: attempt a's steps after the
step attempt a+1 resumed from were lost with the crash and trained again, so they are dropped.
Shared by the recovery tests and `bench/recovery.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = Path(__file__).with_name("recovery_train.py")
REPO = Path(__file__).resolve().parents[3]


@dataclass
class Attempt:
    number: int
    records: dict[int, list[dict]] = field(default_factory=dict)  # rank -> records in order

    def first(self, kind: str, rank: int = 0) -> dict | None:
        return next((r for r in self.records.get(rank, []) if r["kind"] == kind), None)

    def steps(self, rank: int) -> list[dict]:
        return [r for r in self.records.get(rank, []) if r["kind"] == "step"]

    @property
    def resume_step(self) -> int:
        rec = self.first("resume")
        return int(rec["step"]) if rec else -1


def read_attempts(out: Path) -> list[Attempt]:
    attempts: dict[int, Attempt] = {}
    for path in sorted(out.glob("steps_r*_a*.jsonl")):
        rank_part, attempt_part = path.stem.removeprefix("steps_").split("_")
        rank, number = int(rank_part[1:]), int(attempt_part[1:])
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        attempts.setdefault(number, Attempt(number)).records[rank] = lines
    return [attempts[n] for n in sorted(attempts)]


def committed_steps(attempts: list[Attempt]) -> dict[int, dict[int, dict]]:
    """step -> rank -> that step's record, keeping only steps that no later attempt redid."""
    kept: dict[int, dict[int, dict]] = {}
    for i, attempt in enumerate(attempts):
        limit = attempts[i + 1].resume_step if i + 1 < len(attempts) else None
        for rank in attempt.records:
            for rec in attempt.steps(rank):
                if limit is None or rec["step"] <= limit:
                    kept.setdefault(rec["step"], {})[rank] = rec
    return kept


def sample_multiset(steps: dict[int, dict[int, dict]]) -> Counter[tuple[int, int]]:
    """(epoch, sample index) -> times trained, over all committed steps and ranks."""
    seen: Counter[tuple[int, int]] = Counter()
    for by_rank in steps.values():
        for rec in by_rank.values():
            seen.update((rec["epoch"], i) for i in rec["indices"])
    return seen


def recomputed_steps(attempts: list[Attempt], rank: int = 0) -> int:
    """Steps trained more than once on `rank` (work lost to crashes)."""
    total = sum(len(a.steps(rank)) for a in attempts)
    return total - len({r["step"] for a in attempts for r in a.steps(rank)})


def global_losses(steps: dict[int, dict[int, dict]], block_size: int = 32) -> dict[int, float]:
    return {
        step: sum(r["loss_sum"] for r in by_rank.values())
        / (next(iter(by_rank.values()))["count"] * block_size)
        for step, by_rank in steps.items()
    }


def torchrun_command(
    out: Path, ckpt: Path, *extra: str, nproc: int = 2, max_restarts: int = 0
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        str(SCRIPT),
        "--out",
        str(out),
        "--ckpt",
        str(ckpt),
        *extra,
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "src"), env.get("PYTHONPATH", "")])
    )
    env.pop("TRAINSPEC_INJECT", None)
    env.pop("TRAINSPEC_ALLOW_INJECT", None)
    env.update(extra or {})
    return env


def run_job(
    out: Path,
    ckpt: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    nproc: int = 2,
    max_restarts: int = 0,
    timeout_s: float = 240,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        torchrun_command(out, ckpt, *extra, nproc=nproc, max_restarts=max_restarts),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
