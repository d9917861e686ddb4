"""Connect the DDP communication hook of `trainspec.kernels` to a session."""

from __future__ import annotations

from typing import Any


def register_gradient_hook(session: Any, ddp_model: Any) -> Any:
    """Register the compression hook at the configured level; returns the hook (its stats)."""
    from trainspec.kernels.hook import CompressionHook

    hook = CompressionHook.from_config(
        session.config.kernels, process_group=ddp_model.process_group
    )
    hook.register(ddp_model)
    return hook
