"""trainspec: one standard set of metrics for PyTorch training jobs, and a closed loop on them.

`trainspec.init()` starts the collector for this rank and returns a Session; see
`trainspec.runtime`. Importing trainspec imports neither torch nor any exporter.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def init(**kwargs: Any) -> Any:
    """Start trainspec on this rank; see `trainspec.runtime.init.init`."""
    from trainspec.runtime.init import init as _init

    return _init(**kwargs)


def __getattr__(name: str) -> Any:
    """`trainspec.CheckpointError` (what `act.resume()` raises), imported when first read."""
    if name == "CheckpointError":
        from trainspec.runtime.checkpoint_layout import CheckpointError

        return CheckpointError
    raise AttributeError(f"module 'trainspec' has no attribute {name!r}")


__all__ = ["CheckpointError", "__version__", "init"]
