"""Connect the DDP communication hook of `trainspec.kernels` to a session."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from trainspec.runtime import loss_scale
from trainspec.runtime.groups import default_group_timeout_s

log = logging.getLogger("trainspec.runtime")
_FALLBACK_TIMEOUT_S = 300.0  # init's own default for the training group
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
    hook = CompressionHook.from_config(session.config.kernels, process_group=hook_group(ddp_model))
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


def hook_group(ddp_model: Any) -> Any:
    """The group the hook's collectives run on: DDP's own, or, when DDP was built with
    `find_unused_parameters`, a group of their own over the same ranks and backend.

    With that flag DDP all-reduces its map of used parameters on its group at the end of
    backward, while the multi-round levels (int8, lowrank) launch their later rounds from
    future callbacks on a gloo or NCCL thread: on one rank before DDP's collective, on
    another after it, and gloo aborted the job ("op.preamble.length <= op.nbytes", 4 of 4
    runs at int8). On a group of their own the two orders cannot cross. Made only for this
    case: a communicator costs memory on NCCL. Collective: every rank wraps at one point.
    """
    import torch.distributed as dist

    group = ddp_model.process_group
    if not getattr(ddp_model, "find_unused_parameters", False):
        return group
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return group
    timeout = timedelta(seconds=default_group_timeout_s(_FALLBACK_TIMEOUT_S))
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=timeout)
