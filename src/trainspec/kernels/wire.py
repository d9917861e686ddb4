"""The wire: asynchronous collectives that count the bytes this rank really sends.

Byte model (per rank, per collective, `n` = bytes of the tensor this rank passes in,
`W` = world size). We count the bandwidth-optimal ring algorithms, which is what NCCL runs
for large messages and what gloo's ring/"ring_chunked" all-reduce runs:

- all-reduce: reduce-scatter then all-gather, each phase sends W-1 of the W chunks of
  size n/W, so ``2 * (W - 1) * n / W`` bytes (integer division, rounded down).
- all-gather: every rank forwards the W-1 other ranks' payloads around the ring, so
  ``(W - 1) * n`` bytes, which is (W - 1)/W of the gathered output of W * n bytes.
- W == 1: nothing leaves the process, 0 bytes.

Per level (`level_sent_bytes`, for a bucket of n float32 values): `none` and `bf16` all-reduce
4n and 2n bytes; `int8:B` and `topk:F` all-gather each rank's payload (n int8 codes and a
float32 scale per block of B; a float32 value and an int32 index for each of ceil(F n)
entries), so their bytes grow with W - 1 where an all-reduce's stay under twice the payload:
at B = 256, int8 sends more than bf16 from W = 4 on and more than none from W = 8, and topk
no fewer than none once W F reaches 1. The compression policy orders its ladder by these counts
at the job's world size (actuator/compression.py).

Every call also appends a `WireRecord` (the op, the dtype and the byte size of each tensor
really passed to the collective) so tests can recompute the count from the tensors
themselves rather than from our own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainspec.levels import DEFAULT_INT8_BLOCK, Level, fraction_of


@dataclass(frozen=True)
class WireRecord:
    op: str  # "all_reduce" | "all_gather"
    dtype: str
    payload_bytes: int  # bytes of the tensor this rank passed in
    sent_bytes: int  # bytes this rank puts on the wire for it (formula above)


def all_reduce_sent_bytes(payload_bytes: int, world_size: int) -> int:
    return 2 * (world_size - 1) * payload_bytes // world_size if world_size > 1 else 0


def all_gather_sent_bytes(payload_bytes: int, world_size: int) -> int:
    return (world_size - 1) * payload_bytes if world_size > 1 else 0


def level_sent_bytes(level: Level, values: int, world_size: int) -> int | None:
    """Bytes this rank sends for one bucket of `values` float32 gradient values at `level`
    (the codecs' payloads, counted as `Wire` counts them), at `world_size` ranks. None for the
    lowrank levels, whose bytes depend on the shapes of the parameters in the bucket. Not
    counted: the few float32 statistics the hook sends beside a bucket."""
    # Imported here: the codecs import this module.
    from trainspec.kernels.codecs.int8 import block_count
    from trainspec.kernels.codecs.topk import kept_entries

    if level.kind == "none":
        return all_reduce_sent_bytes(4 * values, world_size)
    if level.kind == "bf16":
        return all_reduce_sent_bytes(2 * values, world_size)
    if level.kind == "int8":
        scales = block_count(values, level.param or DEFAULT_INT8_BLOCK)
        return all_gather_sent_bytes(values + 4 * scales, world_size)
    if level.kind == "topk":
        return all_gather_sent_bytes(8 * kept_entries(values, fraction_of(level)), world_size)
    return None


def default_group() -> dist.ProcessGroup:
    """torch.distributed's default group; RuntimeError when none was made."""
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed has no default process group (not initialized)")
    return group


# The devices a torch Future is made for (its constructor's own annotation).
FutureDevices = list[int | str | torch.device]


def future_devices(tensor: torch.Tensor) -> FutureDevices | None:
    """What a future made here must be told to hold values on `tensor`'s device.

    A `torch.futures.Future()` made without devices is a CPU future: completed with CUDA
    tensors, it records no CUDA event, and whoever waits on it (DDP copying a bucket's sum
    into the gradients) does not wait for the streams that computed them (torch's docs for
    `Future`; its source calls this a silent synchronization issue). Given the devices, its
    completion records an event on the current stream and a wait makes the waiter's stream
    wait on it, as futures from `.then` of a NCCL work do. Run on an H100 with gloo (2 ranks)
    and NCCL (1 rank), tests/gpu/test_cuda_paths.py; not with several NCCL ranks."""
    return [tensor.device] if tensor.device.type == "cuda" else None


def completed(value: Any, devices: FutureDevices | None = None) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future(devices=devices)
    fut.set_result(value)
    return fut


def as_error(exc: BaseException) -> Exception:
    """What a callback caught, as an error a future can hold. `add_done_callback` logs and
    drops whatever its callback raises, so a KeyboardInterrupt (a Ctrl-C while a callback
    ran inline on the main thread) caught only as `Exception` left the future unset and
    DDP's backward waiting on it forever; it is set as an error instead."""
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"interrupted in a gradient-hook callback: {type(exc).__name__}")


def follow(
    fut: torch.futures.Future,
    fn: Callable[[Any], Any],
    devices: FutureDevices | None = None,
) -> torch.futures.Future:
    """`fn(fut's value)` as a future, like `fut.then(lambda f: fn(f.value()))`, except that
    an error passes through as it is. With `then`, the callback that reads a failed value
    raises inside torch's callback runner, which wraps it ("Got the following error when
    running the callback: ...", with its own trace): a peer that died reached the script's
    backward() as its gloo error wrapped three times over, once per link of the hook's
    chain. The same CUDA stream semantics as `then` (torch's docs for `add_done_callback`),
    given `devices` (`future_devices`)."""
    out: torch.futures.Future = torch.futures.Future(devices=devices)

    def run(done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except BaseException as exc:  # noqa: BLE001 - handed on, unwrapped
            out.set_exception(as_error(exc))
            return
        try:
            result = fn(value)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(as_error(exc))
            return
        out.set_result(result)

    fut.add_done_callback(run)
    return out


def for_ddp(fut: torch.futures.Future, fn: Callable[[Any], Any]) -> torch.futures.Future:
    """`fn(fut's value)` as the future a DDP communication hook returns. An error set from
    Python (`follow`, `chain`) is the future's value to C++, and DDP read it as a result
    ("Unable to cast ... to Tensor"); the callback runner of `then` makes it an error of
    torch's own, its message wrapped once ("Got the following error when running the
    callback: ..."). So each future handed to DDP is the one link made by `then`."""
    return fut.then(lambda done: fn(done.value()))


def chain(
    fut: torch.futures.Future,
    launch: Callable[[Any], torch.futures.Future],
    devices: FutureDevices | None = None,
) -> torch.futures.Future:
    """`fut.then(launch)` flattened: the result future completes with `launch`'s future.

    torch's `Future.then` does not unwrap a returned future; this does, without a blocking
    `wait()` inside the callback (torch's PowerSGD hook waits there, which can tie up a
    gloo worker thread). Errors propagate to the returned future instead of being lost.
    `devices`: those of the tensors the result holds (`future_devices`), for CUDA.
    """
    out: torch.futures.Future = torch.futures.Future(devices=devices)

    def forward_inner(inner: torch.futures.Future) -> None:
        try:
            out.set_result(inner.value())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(as_error(exc))

    def on_outer(done: torch.futures.Future) -> None:
        try:
            launch(done.value()).add_done_callback(forward_inner)
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(as_error(exc))

    fut.add_done_callback(on_outer)
    return out


class Wire:
    """Sum-all-reduce and all-gather on one process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.records: list[WireRecord] = []
        # The group's own allreduce, as DDP's C++ reducer calls it: dist.all_reduce's Python
        # checks around the same call cost about 55 us of CPU a launch when caches are cold
        # (a launch or two a step; measured for the latency probe, samplers/latency.py).
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]

    def _record(self, op: str, tensor: torch.Tensor, sent: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.records.append(WireRecord(op, str(tensor.dtype), nbytes, sent))

    def sent_bytes(self) -> int:
        return sum(r.sent_bytes for r in self.records)

    def all_reduce(
        self, tensor: torch.Tensor, then: Callable[[torch.Tensor], Any] | None = None
    ) -> torch.futures.Future:
        """Sum `tensor` in place across ranks; the future's value is `tensor`, or
        `then(tensor)` when given (one continuation where a caller would add a second: each
        runs on a gloo thread under the interpreter lock)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._record("all_reduce", tensor, all_reduce_sent_bytes(nbytes, self.world_size))
        if tensor.is_complex():  # dist.all_reduce sums a complex tensor as its real view
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        else:
            pg = self.group if self.group is not None else default_group()
            work = pg.allreduce([tensor], self._sum)
        return follow(work.get_future(), lambda _: tensor if then is None else then(tensor),
                      future_devices(tensor))  # fmt: skip

    def all_gather(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Gather every rank's `tensor` (same shape on all ranks); value: list by rank."""
        nbytes = tensor.numel() * tensor.element_size()
        self._record("all_gather", tensor, all_gather_sent_bytes(nbytes, self.world_size))
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(outputs, tensor, group=self.group, async_op=True)
        return follow(work.get_future(), lambda _: outputs, future_devices(tensor))


class LocalWire(Wire):
    """A world of one: collectives are identities and send nothing.

    Lets codecs be exercised (round trips, error feedback) in one process through the very
    code path the hook uses.
    """

    def __init__(self) -> None:  # noqa: D107 - no process group on purpose
        self.group = None
        self.world_size = 1
        self.records = []

    def all_reduce(
        self, tensor: torch.Tensor, then: Callable[[torch.Tensor], Any] | None = None
    ) -> torch.futures.Future:
        self._record("all_reduce", tensor, 0)
        return completed(tensor if then is None else then(tensor))

    def all_gather(self, tensor: torch.Tensor) -> torch.futures.Future:
        self._record("all_gather", tensor, 0)
        return completed([tensor])
