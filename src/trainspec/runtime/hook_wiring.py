"""Connect the DDP communication hook of `trainspec.kernels` to a session."""

from __future__ import annotations

import logging
from typing import Any

from trainspec.runtime import loss_scale

log = logging.getLogger("trainspec.runtime")
HOOKED = "_trainspec_hook"  # on a DDP model: the hook trainspec registered there (or None)


def is_hooked(model: Any) -> bool:
    """Whether trainspec has registered (or, for sparse gradients, declined) a hook on it."""
    return HOOKED in getattr(model, "__dict__", {})


def hook_of(model: Any) -> Any:
    """The gradient hook trainspec registered on `model` (a DDP model), or None."""
    return getattr(model, "__dict__", {}).get(HOOKED)


def register_gradient_hook(session: Any, ddp_model: Any) -> Any:
    """Register the compression hook at the configured level; returns the hook (its stats).

    None for a model with sparse gradients (an `Embedding` or `EmbeddingBag` built with
    `sparse=True`): its buckets are sparse tensors, which no codec and no squared norm takes,
    and the hook raised in backward. DDP's own all-reduce carries them; the job has no
    gradient statistics and no compression, as a warning says."""
    from trainspec.kernels.hook import CompressionHook

    sparse = sparse_gradient_modules(ddp_model.module)
    if sparse:
        log.warning(
            "trainspec: %s makes sparse gradients: DDP's own all-reduce carries them, with no "
            "gradient statistics and no compression",
            sparse[0],
        )
        return None
    hook = CompressionHook.from_config(
        session.config.kernels, process_group=ddp_model.process_group
    )
    # the noise-scale EMA in the gradient's own units: the scale of the backward whose
    # totals leave, taken then, read when they are (late_stats.py)
    hook.loss_scale = loss_scale.current
    hook.register(ddp_model)
    return hook


def sparse_gradient_modules(model: Any) -> list[str]:
    """Names of the modules of `model` whose gradients are sparse tensors."""
    import torch

    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [
        f"{name or type(m).__name__} ({type(m).__name__}, sparse=True)"
        for name, m in model.named_modules()
        if isinstance(m, kinds) and getattr(m, "sparse", False)
    ]
