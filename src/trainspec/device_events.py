"""CUDA events recorded on the current stream at the least host cost, reused once read.

A step records a few events on the training thread (its phase marks, one behind each copy
to the host), and a launch-bound step pays each one's host time: measured on an H100 host
(`bench/step_path.py`, 2026-11-26), 11-14 us a mark, of which the event's creation and
destruction and `torch.cuda.current_stream`'s Python (a device-index lookup and a new
`Stream` object each call) are most. Here the stream object is built once per raw stream,
and an event whose reading is done goes back to a pool for the next record.

An event may be given back only by the one owner that read it (`StepTiming.seconds`,
`HostValues.floats`): a pooled event is recorded again, so a reader that kept it would read
the later record. Nothing is given back that was not read; an unread event is simply freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# Events kept for reuse per kind, at most: a step holds a few, and a few steps are in
# flight (runtime.session's pending records); more than this is a burst, freed as it ends.
POOL_LIMIT = 256
DEVICE_ATTRIBUTE = "trainspec_device"  # set on each event made here: the device it records on


class FreeList:
    """Things of one kind (events, pinned buffers), made by `factory` when none is free.
    Safe to share between threads (the hook's continuations copy values too): list pop and
    append are atomic."""

    def __init__(self, factory: Callable[[], Any], limit: int = POOL_LIMIT) -> None:
        self._factory = factory
        self._free: list[Any] = []
        self._limit = limit

    def take(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            return self._factory()

    def give_back(self, things: Iterable[Any]) -> None:
        """Things their one owner is done with; those beyond the limit are freed."""
        for thing in things:
            if len(self._free) >= self._limit:
                return
            self._free.append(thing)

    def __len__(self) -> int:
        return len(self._free)


class CurrentStream:
    """`torch.cuda.current_stream(index)` with one `Stream` object per raw stream: the raw
    handle is read each call (the script may switch streams), the object reused."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._read = getattr(torch._C, "_cuda_getCurrentStream", None)  # torch >= 1.x
        self._streams: dict[tuple[int, int, int], Any] = {}

    def __call__(self, index: int) -> Any:
        if self._read is None:  # a torch without the raw read: its public one
            return self._torch.cuda.current_stream(index)
        key = self._read(index)  # (stream id, device index, device type)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
            self._streams[key] = stream
        return stream


class EventRecorder:
    """Records pooled CUDA events on a device's current stream: timing events (phase marks)
    and plain ones (behind a copy to the host). One pool per device and kind: torch records
    an event only on a stream of the device it was made on."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._pools: dict[tuple[int, bool], FreeList] = {}
        self._stream = CurrentStream()

    def record(self, index: int, *, timing: bool) -> Any:
        event = self._pool(index, timing).take()
        event.record(self._stream(index))
        return event

    def give_back(self, events: Iterable[Any], *, timing: bool) -> None:
        """Events that their one owner has read (see the module's doc), each to the pool of
        the device it was made for; an event not made here is left to be freed."""
        for event in events:
            index = getattr(event, DEVICE_ATTRIBUTE, None)
            if index is not None:
                self._pool(index, timing).give_back([event])

    def _pool(self, index: int, timing: bool) -> FreeList:
        pool = self._pools.get((index, timing))
        if pool is None:
            cuda = self._torch.cuda

            def make() -> Any:
                event = cuda.Event(enable_timing=timing)  # bound to a device at its first record
                setattr(event, DEVICE_ATTRIBUTE, index)  # that device: its pool, when given back
                return event

            pool = self._pools.setdefault((index, timing), FreeList(make))
        return pool


_recorder: EventRecorder | None = None


def recorder() -> EventRecorder:
    """The process's recorder (events and streams are per process; one thread records them:
    the training thread, at its steps)."""
    global _recorder
    if _recorder is None:
        _recorder = EventRecorder()
    return _recorder
