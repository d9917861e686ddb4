"""Values of device tensors, brought to the host without a device synchronization.

A step's loss and gradient statistics are tensors on the GPU. Reading one with `float()` (or
`.item()`, `.cpu()`, `.tolist()`) copies it on the current stream and then waits for that
stream: for every kernel queued so far, the next step's included when the read comes late.
Once a step, that stops the host from running ahead of the device, and in a job whose steps
the GPU bounds the device then idles while the host launches the next step's first kernels.

`HostValues` instead copies the values into pinned host memory with `non_blocking=True`
and records an event behind the copy; the values are read once `ready()` (the event
completed), or at a read that must have them now, which waits for that event alone (not
for whatever was queued after it). The pattern of torch's own `non_blocking` device-to-host
copies (`torch.Tensor.to` docs); trainspec reads them when a step's record is made, after
the step's timing events completed. Tensors on the CPU are copied at once, numbers kept.

The pinned buffers and the events are reused once read (`device_events`): a fresh pinned
tensor cost about 27 us of the training thread on an H100 host, twice a step.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

from trainspec.device_events import FreeList, recorder

# Pinned buffers are kept per (shape, dtype) for this many kinds at most (a job copies a
# few: its loss, its norm's sums, the hook's totals), and this many of each kind.
PINNED_KINDS = 32
PINNED_PER_KIND = 64
_pinned: dict[tuple[Any, Any], FreeList] = {}
_READ_LOCK = threading.Lock()  # see HostValues.floats


def _lock_for_child() -> None:
    """A forked child starts with a free lock, whatever a parent's thread held at the fork."""
    global _READ_LOCK
    _READ_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_lock_for_child)


def _pinned_like(value: Any) -> tuple[FreeList | None, Any]:
    """A pinned host tensor shaped as `value`, and the list it goes back to once read
    (None: too many kinds pooled already, a buffer of its own)."""
    import torch

    shape, dtype = value.shape, value.dtype
    pool = _pinned.get((shape, dtype))
    if pool is None:
        if len(_pinned) >= PINNED_KINDS:
            return None, torch.empty(shape, dtype=dtype, pin_memory=True)
        made = FreeList(lambda: torch.empty(shape, dtype=dtype, pin_memory=True), PINNED_PER_KIND)
        pool = _pinned.setdefault((shape, dtype), made)
    return pool, pool.take()


class _NotANumber:
    """A value `float()` refused with something other than TypeError or ValueError (an
    OverflowError for 10**400, whatever a `__float__` raises): read back, a ValueError, which
    the readers of a step's values take as "no value", as they take a string."""

    def __init__(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"

    def __float__(self) -> float:
        raise ValueError(f"not a number ({self.error})")


class HostValues:
    """The elements of a few tensors (or numbers), in order, readable on the host."""

    def __init__(self, *values: Any) -> None:
        import torch

        self._parts: list[Any] = []
        self._events: list[Any] = []  # pooled (device_events), given back once read
        self._lent: list[tuple[FreeList, Any]] = []  # pinned buffers, given back once read
        self._read: list[float] | None = None
        devices = set()
        for value in values:
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.is_cuda:
                    pool, host = _pinned_like(value)
                    host.copy_(value, non_blocking=True)
                    if pool is not None:
                        self._lent.append((pool, host))
                    devices.add(value.device)
                    value = host
                else:  # the value now, whatever the script does to its tensor later
                    value = value.clone()
            else:  # a number (numpy's too, which may change in place): its value now
                try:
                    value = float(value)
                except Exception as exc:  # noqa: BLE001 - 10**400, a __float__ that raises:
                    value = _NotANumber(exc)  # floats() says so, as for a string
            self._parts.append(value)
        for device in devices:  # behind the copies, on the streams that queued them
            self._events.append(recorder().record(device.index, timing=False))

    @property
    def parts(self) -> int:
        """How many values were given."""
        return len(self._parts)

    def ready(self) -> bool:
        """True once every copy landed (at once for host values)."""
        return all(event.query() for event in self._events)

    def floats(self) -> list[float]:
        """Every element of every value, in order, as floats; waits for the copies (only
        them) if they have not landed yet. The first read gives the pinned buffers and the
        events back for later copies; later reads return what it read. One value may have
        readers on two threads (a GradScaler's scale: the step's record and the DDP hook's
        continuation): one read at a time, so nothing is given back twice or read after."""
        with _READ_LOCK:
            if self._read is None:
                for event in self._events:
                    event.synchronize()
                self._read = self._values()
                events, self._events = self._events, []
                recorder().give_back(events, timing=False)
                lent, self._lent = self._lent, []
                for pool, host in lent:
                    pool.give_back([host])
            return list(self._read)

    def _values(self) -> list[float]:
        out: list[float] = []
        for part in self._parts:
            if not hasattr(part, "tolist"):
                out.append(float(part))
                continue
            values = (part if part.dim() < 2 else part.reshape(-1)).tolist()
            if isinstance(values, list):  # a vector; a 0-d tensor gives its number
                out.extend(float(v) for v in values)
            else:
                out.append(float(values))
        return out


def single_float(values: HostValues | None) -> float | None:
    """The one number `values` holds; None for none, or for anything but exactly one."""
    if values is None:
        return None
    try:
        floats = values.floats()
    except (TypeError, ValueError, RuntimeError):
        return None
    return floats[0] if len(floats) == 1 else None


def root_of_sum(*values: HostValues) -> float:
    """sqrt of the sum of every value of `values` (squared norms): NaN when not finite."""
    total = math.sqrt(sum(sum(v.floats()) for v in values))
    return total if math.isfinite(total) else float("nan")
