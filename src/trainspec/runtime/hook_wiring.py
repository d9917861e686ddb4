"""Connect the DDP communication hook of `trainspec.kernels` to a session."""

from __future__ import annotations

import logging
from typing import Any

from trainspec.runtime import loss_scale

log = logging.getLogger("trainspec.runtime")
HOOKED = "_trainspec_hook"  # on a DDP model: the hook trainspec registered there (or None)
# DDP's shadow backward under `join()` (torch's `_DDPJoinHook.main_hook` calls it)
SHADOW_PASS = "_match_all_reduce_for_bwd_pass"


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


def watch_join(session: Any, ddp_model: Any, hook: Any) -> None:
    """DDP's join (`with ddp.join():`, uneven inputs): a rank whose data ran out runs one
    shadow backward for each step the other ranks still train, its zero gradients sent
    through the communication hook (`SHADOW_PASS`). Those passes are no step of this rank's:
    the statistics and bytes they leave in `hook` (trainspec's on this model, or None) are
    dropped as each ends (the short rank's last step stored the others' last gradient norm
    and four passes' bytes, QA 2026-11-27; a rank that trains again, the next epoch, counted
    them in its next step), and the session notes the join (`Session.note_joined`). The
    zero-code layer ends the step that ran before them first: it patches the method on the
    class (auto.py), which is what is wrapped here. The hook marks the passes itself
    (`CompressionHook.register` wraps the method first, so this wraps that): each sends a
    share of 0 and nothing to the statistics' sums, so the ranks still training estimate
    the variance and noise scale over themselves alone."""
    original = getattr(ddp_model, SHADOW_PASS, None)
    if original is None:  # a torch without DDP's join
        return

    def shadow_pass(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            _after_shadow_pass(session, hook)

    vars(ddp_model)[SHADOW_PASS] = shadow_pass


def _after_shadow_pass(session: Any, hook: Any) -> None:
    try:
        if hook is not None:
            hook.step_summary()  # the zeros this rank sent: no step's figures
        session.note_joined()
    except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
        log.warning("trainspec: a shadow pass of DDP's join was not accounted for: %s", exc)
