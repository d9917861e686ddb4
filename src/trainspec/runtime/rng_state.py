"""Random number generator states as JSON: torch (and CUDA), python `random`, numpy if present.

Saved per rank with each checkpoint so a resumed job draws the same numbers the uninterrupted
job would have (dropout masks, data augmentation, anything seeded once at start).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def snapshot_rng() -> dict:
    """The generators' states as objects nobody else mutates (~0.1 ms, against ~0.5 ms for the
    JSON form): a checkpoint takes this on the training thread and encodes it off it."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    state["numpy"] = np.random.get_state()  # a fresh tuple holding a copy of the key array
    return state


def encode_rng(snapshot: dict) -> dict:
    """`snapshot_rng()`'s result as JSON-able values, the form `restore_rng` reads."""
    state: dict[str, Any] = {
        "torch": _b64(snapshot["torch"]),
        "python": _jsonable(snapshot["python"]),
    }
    if "cuda" in snapshot:
        state["cuda"] = [_b64(s) for s in snapshot["cuda"]]
    if "numpy" in snapshot:
        name, keys, pos, has_gauss, cached = snapshot["numpy"]
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def restore_rng(state: dict) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value
