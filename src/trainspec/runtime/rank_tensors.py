"""Tensors that only one rank holds, in a checkpoint file of that rank's own.

dcp saves a plain tensor under one key as replicated: one rank writes it and every rank loads
that copy. Error-feedback residuals differ on every rank, so they go beside the rank's JSON
state instead, as `extra/rank<r>.tensors.pt` (`checkpoint_layout.rank_tensors_path`). The
Checkpointer writes it (temporary name, fsync, rename) before the save's vote and barrier, so
the commit manifest covers it with its size and CRC32 like every shard; a checkpoint whose
ranks had nothing to keep, or one written before this file existed, has none.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import torch

from trainspec.runtime import checkpoint_layout as layout
from trainspec.runtime.checkpoint_layout import CheckpointError


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, taken now: the training loop may go on at once."""
    return {
        name: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()) for name, t in tensors.items()
    }


def write(ckpt_dir: Path, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raises OSError (or what torch.save raises) when the file cannot be written."""
    buffer = io.BytesIO()
    torch.save(dict(tensors), buffer)
    layout.write_atomic(layout.rank_tensors_path(ckpt_dir, rank), buffer.getvalue())


def read(ckpt_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors on the CPU; {} when the checkpoint has none. Raises
    CheckpointError naming the file when it cannot be read or is not named tensors."""
    path = layout.rank_tensors_path(ckpt_dir, rank)
    if not path.is_file():
        return {}
    try:
        loaded = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises many types; each means "unreadable"
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise CheckpointError(f"{path}: not a mapping of names to tensors")
    return loaded
