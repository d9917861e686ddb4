"""The sum of squares of many gradients in one Triton launch: a single process's step norm.

Where the host sets a step's pace (a small model on a fast GPU), the per-step norm's host
time is step time. Through torch it is a `_foreach_norm` over every gradient and then a
stack, a square and a sum of the norms: 0.4-0.5 ms a step of the training thread on an H100
host for a 2 x 128 TinyGPT's 29 gradients (py-spy, docs/benchmarks.md, third GPU session),
most of the launch-bound job's overhead. Here one kernel reads every gradient through a
table of their addresses (the multi-tensor idea of NVIDIA Apex's `multi_tensor_apply`, and
of torch's own foreach kernels), each program squares and sums one block, and one torch sum
adds the blocks' partial sums in float64: two launches, whatever the number of gradients.

The table (addresses, sizes, each block's tensor) is built once and kept while the
gradients stay where they are: the caching allocator gives a steady loop's gradients the
same addresses step after step, so a step costs its addresses and sizes compared, not a
table copied. When they move, the table is rebuilt from pinned memory without a
device synchronization.

Only where it pays and is exact: CUDA gradients of one device and one floating dtype, each
contiguous, at most `MAX_ELEMENTS` in all (a model that large keeps its GPU busy far longer
than the foreach path's host time). Elsewhere `square_sum` returns None and the caller takes
the foreach path. Half-precision gradients are summed in float32 here, where `_foreach_norm`
returns half-precision norms.

Verified on CPU under Triton's interpreter (`tests/unit/test_fused_square_sum.py`); on a GPU
by `tests/gpu/test_cuda_paths.py` when one is lent. Each process also checks its first fused
sum against a float64 sum by torch (one synchronization, at the first step it runs): a kernel
that runs but sums wrongly turns the path off with a warning. Not under CUDA graph capture
(a table's copy would be replayed from released memory) nor for tensor subclasses such as
DTensor (no plain storage to address). The kernel compiles at its first launch, on the
training thread: an early step pays Triton's compile once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton is optional: absent on CPU-only installs; a broken install counts as absent.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None

log = logging.getLogger("trainspec.collector")
BLOCK = 4096  # elements per program
MAX_ELEMENTS = 1 << 26  # beyond this the foreach path's host time hides behind the device's
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_off: list[str] = []  # why the path is off for the whole process (a failed launch)
_checked: list[bool] = []  # the process's first launch was checked against torch's sum
CHECK_RTOL = 1e-4  # float32 partial sums of float32 squares, against a float64 sum


def available() -> bool:
    return triton is not None and not _off


def _interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET, set to debug a user's own kernels): it
    runs kernels on the host, and a table of device addresses read there would crash the
    process rather than raise. CUDA gradients then keep the foreach path."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false")


if triton is not None:

    @triton.jit
    def _block_square_sums_kernel(
        addresses_ptr,
        sizes_ptr,
        first_block_ptr,
        block_tensor_ptr,
        out_ptr,
        BLOCK: tl.constexpr,
        DTYPE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(block_tensor_ptr + pid)
        base = tl.load(addresses_ptr + t).to(tl.pointer_type(DTYPE))
        n = tl.load(sizes_ptr + t)
        offs = (pid - tl.load(first_block_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


# a table's key: the gradients' addresses, sizes and dtypes, and the raw CUDA stream
Key = tuple[tuple[int, ...], tuple[int, ...], tuple[torch.dtype, ...], int]


@dataclass(frozen=True)
class _Table:
    """Where a list of gradients lives, on their device, for one launch."""

    dtype: torch.dtype
    device: torch.device
    tensors: tuple[torch.Tensor, ...]  # addresses, sizes, first block, block -> tensor
    blocks: int


def _build(grads: list[torch.Tensor], key: Key) -> _Table:
    addresses, sizes = key[0], key[1]
    counts = [(n + BLOCK - 1) // BLOCK for n in sizes]
    firsts = [0, *itertools.accumulate(counts)][:-1]
    owner = [i for i, c in enumerate(counts) for _ in range(c)]
    device = grads[0].device
    # Pinned, then copied without blocking: a pageable copy to the device would wait for it.
    host = [
        torch.tensor(list(addresses), dtype=torch.int64),
        torch.tensor(list(sizes), dtype=torch.int64),
        torch.tensor(firsts, dtype=torch.int64),
        torch.tensor(owner, dtype=torch.int32),
    ]
    pin = device.type == "cuda"
    on_device = tuple((t.pin_memory() if pin else t).to(device, non_blocking=pin) for t in host)
    return _Table(grads[0].dtype, device, on_device, len(owner))


class FusedSquareSum:
    """`square_sum(grads)` for one model's gradients, step after step. The tables of the last
    few gradient placements are kept (`TABLES`: a model whose parameters take turns having
    gradients, a mixture of experts, has a few), and a step whose gradients sit where a
    table says costs its key compared: the addresses, sizes and dtypes, and the stream.
    A table is built only for a list that passed every check (one CUDA device, one dtype the
    kernel reads, each contiguous, not too large; a list that failed is remembered as such,
    not checked again every step); an address is unique to its device, and
    autograd gives a parameter's gradient the parameter's layout. A table is used only on
    the stream it was built on: its copy to the device and, once evicted, the release of its
    memory are ordered on that stream."""

    TABLES = 4

    def __init__(self, *, enabled: bool = True, interpret: bool = False) -> None:
        self._tables: dict[Key, _Table | None] = {}  # None: a list one launch cannot sum
        self._lock = threading.Lock()
        self._enabled = enabled and available()
        self._interpret = interpret  # CPU tensors under TRITON_INTERPRET=1 (tests)
        self.builds = 0  # tables built (a test reads it: a steady loop builds one)

    def square_sum(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """sum(|g|^2) over `grads` as a float64 0-d tensor on their device, launched without
        a synchronization; None where this path does not apply (see the module)."""
        if not self._enabled or _off or not grads:
            return None
        first = grads[0]
        if type(first) is not torch.Tensor:  # DTensor and other subclasses: no plain storage
            return None
        if first.is_cuda:
            if self._interpret or _interpreting():
                return None
            if torch.cuda.is_current_stream_capturing():  # a table copied once, replayed on
                return None
            stream = torch._C._cuda_getCurrentRawStream(first.device.index)
        elif self._interpret:
            stream = 0
        else:
            return None
        try:
            # Sizes too: a parameter whose gradient is None this step can leave another's
            # gradient at the same address, and the table's size would read past it.
            key: Key = (
                tuple(map(torch.Tensor.data_ptr, grads)),
                tuple(map(torch.Tensor.numel, grads)),
                tuple(g.dtype for g in grads),
                stream,
            )
            with self._lock:
                known, table = key in self._tables, self._tables.get(key)
            if not known:  # checked once per placement, not every step
                table = _build(grads, key) if _one_launch_applies(grads) else None
                self._remember(key, table)
            if table is None:
                return None
            result = _launch(table)
            if not _checked:
                _check_once(result, grads)  # raises WrongSum where the kernel summed wrongly
            return result
        except Exception as exc:  # a GPU or Triton this kernel does not build for
            _turn_off(f"{type(exc).__name__}: {exc}")
            return None

    def _remember(self, key: Key, table: _Table | None) -> None:
        with self._lock:
            while len(self._tables) >= self.TABLES:
                del self._tables[next(iter(self._tables))]  # the oldest
            self._tables[key] = table
            self.builds += table is not None


def _turn_off(why: str) -> None:
    if not _off:
        _off.append(why)
        log.warning("trainspec: fused gradient norm off, torch's foreach path instead: %s", why)


class WrongSum(RuntimeError):
    """The fused kernel's sum disagreed with torch's on this machine."""


def _check_once(result: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """The process's first finite fused sum against torch's, read at once (one device
    synchronization per process, at the first step with finite gradients): a kernel that
    compiles but sums wrongly on some GPU or Triton version turns the path off instead of
    reporting a wrong norm for the whole run. Raises WrongSum naming both values. A sum
    that is not finite (a step a loss scaler skips) waits for a later one; a check that
    cannot run (no memory, torch's sync debug mode) is not tried again."""
    try:
        # Each gradient's norm accumulated in float32 (no float64 copy of a large gradient),
        # their squares summed in float64: well inside the tolerance.
        norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads]
        want = float(torch.stack(norms).double().square().sum())
        got = float(result)
    except Exception as exc:  # noqa: BLE001 - the check is a safeguard, never a failure
        log.debug("trainspec: the fused sum's one check could not run: %s", exc)
        _checked.append(True)
        return
    if not (math.isfinite(got) and math.isfinite(want)):
        return
    _checked.append(True)
    if abs(got - want) > CHECK_RTOL * abs(want):
        raise WrongSum(f"the fused sum of squares read {got!r}, torch's {want!r}")


def _one_launch_applies(grads: list[torch.Tensor]) -> bool:
    """One device, one floating dtype the kernel reads, each contiguous, at most
    MAX_ELEMENTS in all: then one launch over the addresses is the exact sum."""
    dtype, device = grads[0].dtype, grads[0].device
    if dtype not in _DTYPES:
        return False
    total = 0
    for g in grads:
        if g.dtype is not dtype or g.device != device or not g.is_contiguous():
            return False
        if type(g) is not torch.Tensor or (g.numel() and not g.data_ptr()):  # no plain storage
            return False
        total += g.numel()
    return 0 < total <= MAX_ELEMENTS


def _launch(table: _Table) -> torch.Tensor:
    device = table.device
    partials = torch.empty(table.blocks, dtype=torch.float32, device=device)
    # Triton launches on the current device's current stream: the gradients' device, as
    # torch's own ops on them would.
    elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if elsewhere else contextlib.nullcontext():
        _block_square_sums_kernel[(table.blocks,)](
            *table.tensors, partials, BLOCK=BLOCK, DTYPE=_TRITON_DTYPES[table.dtype]
        )
    return partials.sum(dtype=torch.float64)


_TRITON_DTYPES: dict[torch.dtype, Any] = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if tl is not None
    else {}
)
