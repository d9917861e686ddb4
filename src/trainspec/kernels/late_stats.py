"""A step's gradient statistics while the hook's totals are still on their way from the GPU.

The hook's three summed totals and its two squared norms are device tensors when the last
bucket's all-reduce completes. Read with `.cpu()` in that continuation, they made a DDP
backward on CUDA wait for its own last all-reduce before returning, so the optimizer step was
launched onto an idle GPU. Instead the hook copies them to pinned host memory without waiting
(`trainspec.host_copy`) and computes the step's statistics when somebody needs them: the next
step's first bucket (error feedback must know before then whether a rank aborted the step),
`latest_stats()`, or the session once the step's values landed (`LateStats`). On the CPU the
copy is done at once and the statistics are computed in the continuation, as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainspec.host_copy import HostValues
from trainspec.kernels.stats import GradientStats
from trainspec.kernels.wire import WireRecord


@dataclass
class Unpublished:
    """One backward's totals in flight, with what its statistics need from that moment."""

    step: int
    level: str
    # [sum |g_r|^2, sum 1/n_r, sum n_r, flags], then |sum|^2, then |g_local|^2 (the hook's
    # `_stats_scalars`)
    values: HostValues
    scale: Any  # the loss scale of this backward (`CompressionHook.loss_scale`), read late
    allreduce_s: float
    records: tuple[WireRecord, ...]
    global_batch: int | None
    last_bucket_ready: float | None
    consumed: dict[int, Any]  # the residuals this step took, owed again if it is void
    # What the sum was multiplied by before DDP applied it: N / (samples trained) where
    # some rank sat the step out (DDP's join) and DDP averages over those that trained
    applied_factor: float = 1.0
    summary: LateStats | None = None  # handed out by `step_summary` before it was computed
    done: bool = False
    result: GradientStats | None = None  # None: void (a rank aborted) or not computable
    # The noise-scale EMA's terms once this step is computed: after its update, or as they
    # stood when the step is void (what several models' noise scale combines from).
    held_terms: tuple[float, float] | None = None


def _field(name: str) -> Any:
    return property(lambda self: self.figure(name))


class LateFigures(ABC):
    """The fields of a step's statistics (`GradientFigures`), each read through `figure`,
    which computes them at the first read: for sources whose values are still in flight."""

    @abstractmethod
    def figure(self, name: str) -> Any:
        """The statistic `name` of the step, computed if it is not yet."""

    grad_norm = _field("grad_norm")
    grad_variance = _field("grad_variance")
    grad_noise_scale = _field("grad_noise_scale")
    comm_bytes = _field("comm_bytes")
    allreduce_s = _field("allreduce_s")
    last_bucket_ready = _field("last_bucket_ready")
    compression = _field("compression")


class LateStats(LateFigures):
    """`GradientFigures` of a step whose totals are in flight. `ready()` says whether they
    landed; the first field read computes them (`settle`, the hook's), waiting for that copy
    alone if need be. `comm_bytes` and `allreduce_s` count every backward since the previous
    summary, this one's included once it is computed."""

    def __init__(
        self, settle: Callable[[], None], pending: Unpublished, nbytes: int, seconds: float
    ) -> None:
        self._settle = settle
        self._pending = pending
        self._bytes = nbytes
        self._seconds = seconds
        self._taken = (nbytes, seconds)

    def ready(self) -> bool:
        return self._pending.done or self._pending.values.ready()

    @property
    def taken(self) -> tuple[int, float]:
        """The bytes and seconds of the passes before this one that it took over."""
        return self._taken

    def add(self, nbytes: int, seconds: float) -> None:
        """This backward's own bytes and seconds, once computed (the hook, under its lock)."""
        self._bytes += nbytes
        self._seconds += seconds

    noise_terms = _field("noise_terms")

    def figure(self, name: str) -> Any:
        if not self._pending.done:
            self._settle()
        if name == "noise_terms":  # a void step's too: the terms it left unchanged
            return self._pending.held_terms
        stats = self._pending.result
        if stats is None:
            return None
        if name == "comm_bytes":
            return self._bytes
        if name == "allreduce_s":
            return self._seconds
        return getattr(stats, name)
