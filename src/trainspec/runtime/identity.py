"""Who this process is in the job: read from torchrun's environment, never re-invented."""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    local_rank: int
    world_size: int
    host: str

    @property
    def writer(self) -> str:
        return f"rank-{self.rank}"

    def resource(self, run_id: str, service_name: str) -> dict[str, str | int]:
        """The resource attributes DESIGN.md puts on every series."""
        return {
            "service.name": service_name,
            "trainspec.run.id": run_id,
            "host.name": self.host,
            "trainspec.rank": self.rank,
            "trainspec.local_rank": self.local_rank,
            "trainspec.world_size": self.world_size,
        }


def _int_env(environ: dict[str, str], key: str, default: int) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment {key}={raw!r} is not an integer") from exc


def launched_world_size(environ: dict[str, str] | None = None) -> int:
    """WORLD_SIZE as the launcher set it; 1 where unset or not a count (what needs it only
    asks whether this process is one of several)."""
    try:
        return max(1, _int_env(dict(os.environ) if environ is None else environ, "WORLD_SIZE", 1))
    except ValueError:
        return 1


def restart_count(environ: dict[str, str] | None = None) -> int:
    """torchrun's restart count of this job (TORCHELASTIC_RESTART_COUNT), 0 outside torchrun.
    A value that is not a count is read as 0: it is torchrun's to set, and a bad one must
    not stop the job."""
    text = (os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "")
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else 0


def identity_from_env(environ: dict[str, str] | None = None) -> RankIdentity:
    env = dict(os.environ if environ is None else environ)
    rank = _int_env(env, "RANK", 0)
    world = _int_env(env, "WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return RankIdentity(rank, _int_env(env, "LOCAL_RANK", 0), world, socket.gethostname())


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def run_id_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The run id every rank agrees on without talking: ours, else torchrun's rendezvous id."""
    env = os.environ if environ is None else environ
    if env.get("TRAINSPEC_STORE_RUN_ID"):
        return env["TRAINSPEC_STORE_RUN_ID"]
    rdzv = env.get("TORCHELASTIC_RUN_ID", "")
    return rdzv if rdzv and rdzv != "none" else None
