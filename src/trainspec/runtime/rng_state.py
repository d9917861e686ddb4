"""Random number generator states as JSON: torch (and CUDA), python `random`, numpy if present.

Saved per rank with each checkpoint so a resumed job draws the same numbers the uninterrupted
job would have (dropout masks, data augmentation, anything seeded once at start).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def capture_rng() -> dict:
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


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
