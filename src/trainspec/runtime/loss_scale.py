"""The loss scale a step's backward ran at, so gradient statistics read before unscaling are
reported in the gradient's own units.

Mixed precision's `GradScaler` multiplies the loss by its scale s (65,536 at first) before
backward and divides the gradients by s only just before the optimizer step. The DDP hook and
the micro-step statistics read the gradients during backward, so their norm came out s times
too large and the variance s^2 times (a norm of 578,837 for one of 8.8), and every change of
s (halved at an overflow, doubled every 2,000 clean steps) looked to the actuator like a
change in the gradient. The noise scale is a ratio of the two and was right.

`install()` wraps `GradScaler.scale` once per process: each call records the scale it applied
(`scaler.scale(loss)` runs before that loss's backward), and the session takes the latest at
each step's end. On CUDA the value is copied to pinned host memory without waiting
(`host_copy.HostValues`, which waits on that copy alone if read early), and read
when the step's record is made: after the step's timing events completed (CUDA clock), or,
on the host clock, after the step's statistics were read to the host (the DDP hook) or the
scaler's own inf check synchronized (non-fused optimizers), all queued after the copy. No
device synchronization is added. Not verified on a GPU here (none was lent).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from trainspec.host_copy import HostValues, single_float

_lock = threading.Lock()
_latest: Any = None  # a host tensor holding the scale of the latest scale() call
_installed = False
_before_unscale: list[Callable[[], None]] = []  # called as a GradScaler unscales gradients


def install() -> None:
    """Record every GradScaler's applied scale from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from torch.amp import GradScaler

    original = GradScaler.scale

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        result = original(self, outputs)
        _record(self)
        return result

    GradScaler.scale = scale  # type: ignore[method-assign]
    original_unscale = GradScaler.unscale_

    @functools.wraps(original_unscale)
    def unscale_(self: Any, optimizer: Any) -> Any:
        for listener in list(_before_unscale):
            with contextlib.suppress(Exception):  # a listener costs its own reading only
                listener()
        return original_unscale(self, optimizer)

    GradScaler.unscale_ = unscale_  # type: ignore[method-assign]


def before_unscale(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener()` whenever a GradScaler is about to unscale gradients (its `step`
    does, or the script before clipping), while they still carry the scale; returns the
    call that removes it. The automatic phases end a step's last micro-step there
    (phase_hooks.py): observed after, it mixed scaled and unscaled gradients."""
    with _lock:
        _before_unscale.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _before_unscale:
                _before_unscale.remove(listener)

    return remove


def _record(scaler: Any) -> None:
    global _latest
    value = getattr(scaler, "_scale", None)
    if not scaler.is_enabled() or value is None:
        return
    try:
        host = HostValues(value)  # pinned and without waiting on CUDA, with its own event
    except Exception:  # noqa: BLE001 - a failed read costs the statistics' units, not the step
        return
    with _lock:
        _latest = host


def take() -> Any:
    """The scale recorded since the last take (a host tensor, read once the step's device work
    is done), or None where no GradScaler scaled a loss."""
    global _latest
    with _lock:
        latest, _latest = _latest, None
    return latest


def current() -> Any:
    """The latest recorded scale as it was recorded (a host tensor, its copy perhaps still in
    flight), left for `take`; None where there is none. For readers that read it later, with
    values copied after it (`microsteps.py`): `value()` then."""
    with _lock:
        return _latest


def value(scale: Any) -> float | None:
    """The scale as a number; None for none, or one that is not a positive finite number."""
    if scale is None:
        return None
    if isinstance(scale, HostValues):  # waits for its own copy alone, if still in flight
        number = single_float(scale)
        if number is None:
            return None
    else:
        try:
            number = float(scale)
        except (TypeError, ValueError, RuntimeError):
            return None
    return number if number > 0 and number != float("inf") else None
