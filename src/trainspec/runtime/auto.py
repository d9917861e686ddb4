"""Zero-code instrumentation: what `trainspec run -- torchrun ... script.py` injects.

Like `opentelemetry-instrument` for services, it patches the libraries the script already
uses rather than the script:
- `torch.distributed.init_process_group`: trainspec starts right after it (same program point
  on every rank, so the side groups can be created). A torchrun worker that makes no group
  starts at its first optimizer step; a process no launcher started (`trainspec run --
  python train.py`) at its first training batch or backward. A multiprocessing worker
  (`torch.multiprocessing.spawn`) starts only at its group, its rank and world size the
  group's; the script that spawns it trains nothing and is never measured.
- `DistributedDataParallel.__init__`: times forward, and registers trainspec's gradient hook
  at the model's first forward with gradients on; `register_comm_hook` (and its built-in
  variant): a script that registers its own hook before then keeps it, and trainspec's stays
  off that model (DDP takes one hook). A forward of a model in `eval()` mode with gradients
  on trains if a backward follows it before the next forward or batch; else it evaluated.
- `torch.autograd.backward` (which `loss.backward()` calls): with no DDP model, the phases:
  forward from the step's batch (or its start) to the backward call, backward the call
  itself; the gradient norm is then read from the optimizers' parameters at their step (the
  norm `clip_grad_norm_` saw, when the script clips). No module hook is used, so a
  `torch.compile`d model compiles as it would without trainspec.
- the DataLoader iterator's `__next__`: data wait and samples per step (the first dimension
  of each batch a step trains on: the batch each forward with gradients trains on, told by
  its input (without DDP, each backward's, the oldest asked for), so gradient
  accumulation's micro-batches and loaders zipped together add up, a loop that reads one
  batch ahead counts the batch it trains on and an evaluation loop under `no_grad` does not;
  `runtime/batches.py`). A step that reads no batch and takes none (tensors in memory, after
  a loader's evaluation or warm-up) counts its forwards' inputs.
- global optimizer step hooks: the step boundary (forward end -> optimizer pre-hook is
  backward; pre -> post hook is the optimizer phase). A step is over once every optimizer
  the script steps has stepped in it, so several optimizers make one step; it is closed at
  what comes next (a batch, a forward or backward, an optimizer stepping again), so an
  optimizer that steps for the first time after the others (every other batch, or unfrozen
  mid-run) joins the step it stepped in. An optimizer step with a closure (LBFGS) times the
  closure's forward and backward as those phases, not as the optimizer's.
- `GradScaler.step` (mixed precision's loss scaling): an optimizer step the scaler skips for
  inf or NaN gradients still ends the training step, with an `optimizer_step_skipped` event
  (it merged into the next step, which then reported half its samples at twice its time).
  A fused optimizer (`fused=True`) is stepped even then and skips inside its kernel: its
  step ends as usual, with no such event (reading the scaler's verdict would wait on the
  device at every step); the non-finite gradients still raise `nonfinite_gradients`.
- `torch.distributed.destroy_process_group`: closes trainspec first, every rank in step.
- DDP's shadow backward under `join()` (uneven inputs): the rank's data ran out, its last
  step is over, and the passes it shadows are none of its steps (`hook_wiring.watch_join`).
- `sys.excepthook`: an exception the script does not catch fails the step it ran in (a
  `step_failed` fault, as in the explicit API's `step()` block); a script that replaced the
  hook is seen ending at exit all the same (`sys.last_value`, `runtime/exit_status.py`).
- `sys.exit` and the `exit()` builtin: a failing code (not 0, not None) that ends the
  process fails the step in progress as that exception does (`on_exit`); one the script
  catches does not. Not seen: `raise SystemExit(code)` written in the script.
- `os._exit`, after which no atexit handler runs: in the process whose session it is (not a
  forked DataLoader worker), a failing code fails the step in progress (`HardExit`), and the
  session is flushed and closed (`on_os_exit`), waited for 3 s at most; then the real one.

A script that calls `trainspec.init()` itself measures itself: the zero-code layer stands
down (`stand_down`) and the script's own `step()` blocks and `wrap()` take over, in the one
session (the script's `wrap` of a model the layer already hooked keeps that hook).
"""

from __future__ import annotations

import builtins
import functools
import os
import sys
import time
from typing import Any

from trainspec.runtime.auto_containment import contained
from trainspec.runtime.auto_ddp_patches import (
    SECOND_HOOK,
    _comm_hook_registration,
    _join_shadow_pass,
)
from trainspec.runtime.auto_exit_hooks import _excepthook, _exit_watched, _os_exit_watched
from trainspec.runtime.auto_instrumentation import AutoInstrumentation, torch_grad_enabled
from trainspec.runtime.auto_session import EARLY_MARKS_MAX

# Imported from here by the rest of trainspec and by the tests (the layer's parts live in
# `runtime/auto_*.py`).
__all__ = [
    "EARLY_MARKS_MAX",
    "SECOND_HOOK",
    "AutoInstrumentation",
    "_comm_hook_registration",
    "_excepthook",
    "_exit_watched",
    "_is_l2",
    "_join_shadow_pass",
    "_os_exit_watched",
    "contained",
    "install",
    "installed",
    "torch_grad_enabled",
]

_installed: AutoInstrumentation | None = None


def installed() -> AutoInstrumentation | None:
    """The zero-code instrumentation of this process (`trainspec run`), if any."""
    return _installed


def _is_l2(norm_type: Any) -> bool:
    """Whether a `clip_grad_norm_` norm type is the L2 norm (2, 2.0, "2"; not inf or 1)."""
    try:
        return float(norm_type) == 2.0
    except (TypeError, ValueError):
        return False


def install(*, group_only: bool = False) -> AutoInstrumentation:
    """Patch torch for this process; returns the instrumentation object. `group_only`: a
    multiprocessing worker, measured from its process group on (`AutoInstrumentation`)."""
    # Every import first: a torch without one of these leaves the script wholly unpatched.
    import torch
    import torch.distributed as dist
    from torch.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

    from trainspec.runtime.hook_wiring import SHADOW_PASS

    global _installed
    auto = _installed = AutoInstrumentation(group_only=group_only)

    original_init_pg = dist.init_process_group

    @functools.wraps(original_init_pg)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original_init_pg(*args, **kwargs)
        contained(auto, auto.on_group_made)
        return result

    dist.init_process_group = init_process_group

    original_destroy = dist.destroy_process_group

    @functools.wraps(original_destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.close)
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    shadow_pass = getattr(DistributedDataParallel, SHADOW_PASS, None)
    if shadow_pass is not None:  # (wrapped again per model by `hook_wiring.watch_join`)
        setattr(DistributedDataParallel, SHADOW_PASS, _join_shadow_pass(auto, shadow_pass))

    sys.excepthook = _excepthook(auto, sys.excepthook)
    sys.exit = _exit_watched(auto, sys.exit)
    quitter = type(getattr(builtins, "exit", None))  # `_sitebuiltins.Quitter`, with `site`
    if quitter.__module__ == "_sitebuiltins":
        quitter.__call__ = _exit_watched(auto, quitter.__call__)  # type: ignore[method-assign]
    os._exit = _os_exit_watched(auto, os._exit)

    original_ddp_init = DistributedDataParallel.__init__

    @functools.wraps(original_ddp_init)
    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_ddp_init(self, *args, **kwargs)
        contained(auto, auto.on_ddp_model, self)

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    for name in ("register_comm_hook", "_register_builtin_comm_hook"):
        original = getattr(DistributedDataParallel, name, None)
        if original is not None:
            setattr(DistributedDataParallel, name, _comm_hook_registration(auto, original))

    original_next = dataloader._BaseDataLoaderIter.__next__

    @functools.wraps(original_next)
    def next_batch(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            batch = original_next(self)
        except StopIteration:
            contained(auto, auto.on_loader_end, self)
            raise
        contained(auto, auto.on_batch, batch, time.perf_counter() - t0, self)
        return batch

    dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]

    from torch.nn.utils import clip_grad

    original_clip = clip_grad.clip_grad_norm_

    @functools.wraps(original_clip)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)  # a generator would be used up by the read
        norm_type = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)
        # An L2 clip's own result is the norm before it, where nothing clipped or read those
        # gradients before it in this step (a check that fails takes the per-parameter read).
        if _is_l2(norm_type) and contained(auto, auto.clip_reusable, parameters):
            total = original_clip(parameters, *args, **kwargs)
            contained(auto, auto.after_clip, parameters, total)
            return total
        contained(auto, auto.before_clip, parameters)
        return original_clip(parameters, *args, **kwargs)

    original_backward = torch.autograd.backward

    @functools.wraps(original_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_backward_start)
        result = original_backward(*args, **kwargs)
        contained(auto, auto.on_backward_end)
        return result

    torch.autograd.backward = backward

    clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    os.register_at_fork(after_in_child=auto.after_fork_in_child)

    original_scaler_step = GradScaler.step

    @functools.wraps(original_scaler_step)
    def scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        stepped = auto.optimizer_steps
        result = original_scaler_step(self, optimizer, *args, **kwargs)
        if auto.optimizer_steps == stepped:  # skipped: inf or NaN in the unscaled gradients
            contained(auto, auto.on_optimizer_skipped, optimizer)
        return result

    GradScaler.step = scaler_step  # type: ignore[method-assign]

    register_optimizer_step_pre_hook(lambda opt, a, k: contained(auto, auto.on_optimizer_pre, opt))
    register_optimizer_step_post_hook(
        lambda opt, a, k: contained(auto, auto.on_optimizer_post, opt)
    )
    # A script that never destroys its process group is flushed by init's atexit handler.
    return auto
