"""The small future and CUDA-stream helpers of the compression hook's bucket chain (hook.py):
a continuation that launches a bucket waits for the work queued for it on the backward's
stream, and a level that launches at once gets its synchronous errors on a future."""

from __future__ import annotations

from typing import Any

import torch

from trainspec.kernels.wire import FutureDevices


def _same(value: Any) -> Any:
    return value


def _stream_mark(grad: torch.Tensor) -> Any:
    """CUDA: an event after the work this thread has queued for the bucket (its backward,
    its squared norm, its residual); None elsewhere. A continuation of a device future runs
    on pool streams that wait only for that future's own events (torch's ivalue Future
    `invokeCallback`), not for the stream that wrote the next bucket."""
    if grad.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(grad.device))
    return event


def _wait_for(mark: Any, device: torch.device) -> None:
    """Make the current stream wait for `mark` (`_stream_mark`); nothing off CUDA."""
    if mark is not None:
        torch.cuda.current_stream(device).wait_event(mark)


def _launch_now(launch: Any, devices: FutureDevices | None) -> torch.futures.Future:
    """`launch(None)` now, with a synchronous error set on the future (as `chain` does)."""
    try:
        return launch(None)
    except Exception as exc:  # noqa: BLE001 - DDP raises it from backward()
        fut: torch.futures.Future = torch.futures.Future(devices=devices)
        fut.set_exception(exc)
        return fut
