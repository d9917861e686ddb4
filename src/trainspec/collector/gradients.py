"""How the collector reads gradient statistics without importing whoever computes them.

The DDP communication hook in `trainspec.kernels` satisfies `GradientStatsSource`; so does
`ParameterGradientNorm` below, used in single-process runs with no hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainspec.host_copy import HostValues, root_of_sum


@dataclass(frozen=True)
class GradientSummary:
    """What a step row needs; any field the source cannot know is None."""

    grad_norm: float | None = None
    grad_variance: float | None = None
    grad_noise_scale: float | None = None
    comm_bytes: int | None = None
    allreduce_s: float | None = None
    last_bucket_ready: float | None = None  # perf_counter when the last bucket was handed off
    compression: str | None = None

    @classmethod
    def of(cls, figures: GradientFigures) -> GradientSummary:
        """The fields a step row takes, from any source's statistics."""
        return cls(
            grad_norm=figures.grad_norm,
            grad_variance=figures.grad_variance,
            grad_noise_scale=figures.grad_noise_scale,
            comm_bytes=figures.comm_bytes,
            allreduce_s=figures.allreduce_s,
            last_bucket_ready=figures.last_bucket_ready,
            compression=figures.compression,
        )


class GradientFigures(Protocol):
    """What the session reads of a step's statistics: a `GradientSummary`, or the kernels'
    own `GradientStats` (which has these and more)."""

    @property
    def grad_norm(self) -> float | None: ...
    @property
    def grad_variance(self) -> float | None: ...
    @property
    def grad_noise_scale(self) -> float | None: ...
    @property
    def comm_bytes(self) -> int | None: ...
    @property
    def allreduce_s(self) -> float | None: ...
    @property
    def last_bucket_ready(self) -> float | None: ...
    @property
    def compression(self) -> str | None: ...


class GradientStatsSource(Protocol):
    def step_summary(self) -> GradientFigures | None:
        """Statistics of the most recent completed backward, or None if none yet."""


class DeferredNorm:
    """A step's gradient norm whose value is still on its way from the device (`host_copy`):
    read when the step's record is made, once `ready()`. The other figures are unknown."""

    grad_variance = None
    grad_noise_scale = None
    comm_bytes = None
    allreduce_s = None
    last_bucket_ready = None
    compression = None

    def __init__(self, *squared: HostValues) -> None:
        self._squared = squared  # squared norms, summed over all of them
        self._norm: float | None = None

    def ready(self) -> bool:
        return all(v.ready() for v in self._squared)

    @property
    def grad_norm(self) -> float:
        if self._norm is None:
            self._norm = root_of_sum(*self._squared)
        return self._norm


class ParameterGradientNorm:
    """Norm of the gradients of one or more models' parameters (a single process, no hook).
    Each model's is taken at its own update: `capture` for the first model's parameters, the
    callable `watch` returns for each model added later. A step's norm is over every model
    taken since the last summary, each model's latest once (two models in one job: a GAN,
    or an encoder and a decoder wrapped apart)."""

    reads_after_unscale = True  # at the optimizer step: a GradScaler has unscaled them

    def __init__(self, parameters: Any, *, fused: bool = True) -> None:
        self._groups: list[list[Any]] = []
        self._use_fused = fused  # False: torch's foreach path only (bench/step_path.py)
        self._fused: list[Any] = []  # per model: its FusedSquareSum (one launch on CUDA)
        self._taken: dict[int, HostValues] = {}  # model -> its squared sums, on their way
        self.watch(parameters)

    def watch(self, parameters: Any) -> Callable[[], None]:
        """Add a model's parameters; returns what takes their norm (`capture` for it). A
        parameter watched already (the same model wrapped twice, shared layers) is left to
        the model that brought it, so no gradient counts twice."""
        from trainspec.collector.fused_square_sum import FusedSquareSum

        seen = {id(p) for group in self._groups for p in group}
        index = len(self._groups)
        self._groups.append([p for p in parameters if p.requires_grad and id(p) not in seen])
        self._fused.append(FusedSquareSum(enabled=self._use_fused))
        return lambda: self._capture(index)

    def capture(self) -> None:
        """Take the first model's norm now (call after backward, before gradients are
        zeroed); its value reaches the host without a device synchronization."""
        self._capture(0)

    def _capture(self, index: int) -> None:
        sums = square_sums_of(self._groups[index], self._fused[index])
        if sums:  # copied now, behind the backward, not behind the update as well
            self._taken[index] = HostValues(*sums)

    def step_summary(self) -> DeferredNorm | None:
        if not self._taken:
            return None
        taken, self._taken = self._taken, {}
        return DeferredNorm(*taken.values())


def gradient_norms(parameters: Any) -> dict[int, Any]:
    """Each dense gradient's L2 norm (a 0-d tensor on its own device), by id(parameter)."""
    import torch

    with_grads = [p for p in parameters if p.grad is not None and not p.grad.is_sparse]
    by_device: dict[Any, list[Any]] = {}
    for p in with_grads:
        by_device.setdefault(p.grad.device, []).append(p)
    norms: dict[int, Any] = {}
    for params in by_device.values():  # _foreach_norm takes one device's tensors at a time
        for p, norm in zip(params, torch._foreach_norm([p.grad for p in params]), strict=True):
            norms[id(p)] = norm
    return norms


def square_sums_of(parameters: list[Any], fused: Any) -> list[Any]:
    """sum(|grad|^2) over `parameters`' dense gradients, one 0-d tensor per device, left on
    the device: from one fused launch (`fused`, a `FusedSquareSum`) where it applies, else
    through `_foreach_norm`; [] for no gradients."""
    grads = dense_grads(parameters)
    total = fused.square_sum(grads)
    if total is not None:
        return [total]
    return squared_sums(foreach_norms(grads, parameters))


def dense_grads(parameters: list[Any]) -> list[Any]:
    """The dense (strided) gradients of `parameters`, in order; one read of `.grad` and of
    its layout per parameter, no dict: where the host launches a small model's steps,
    Python per parameter is step time (243 -> 158 us a capture on a 2 x 128 TinyGPT here,
    211 -> 147 us on an H100 host, bench/step_path.py)."""
    import torch

    strided = torch.strided
    return [g for p in parameters if (g := p.grad) is not None and g.layout is strided]


def foreach_norms(grads: list[Any], parameters: list[Any]) -> list[Any]:
    """Each of `grads`' L2 norms (0-d tensors on their devices) from one `_foreach_norm`;
    per device (`gradient_norms` over `parameters`) where a torch takes one device's tensors
    at a time."""
    import torch

    if not grads:
        return []
    try:
        return list(torch._foreach_norm(grads))
    except RuntimeError:
        return list(gradient_norms(parameters).values())


def squared_sums(norms: Any) -> list[Any]:
    """The sum of the squares of `norms` (0-d tensors, on any devices), one 0-d tensor per
    device, left on the device (read them with `host_copy.HostValues`); [] for no norms.
    One device (the usual case) is one stack and one dot, with no per-norm Python: 24 -> 15
    us for 29 norms on the 2-core VM, and one launch fewer on a GPU."""
    import torch

    def sum_of_squares(ns: list[Any]) -> Any:
        stacked = torch.stack(ns).float()
        return torch.dot(stacked, stacked)

    norms = list(norms)
    if not norms:
        return []
    try:
        return [sum_of_squares(norms)]
    except RuntimeError:  # norms on several devices: one sum per device
        by_device: dict[Any, list[Any]] = {}
        for n in norms:
            by_device.setdefault(n.device, []).append(n)
        return [sum_of_squares(ns) for ns in by_device.values()]


@dataclass(eq=False)
class ClipRecord:
    """One L2 `clip_grad_norm_` of a step: the ids of the parameters it covered and its
    result, their norm before it clipped. `counted` once a read has added it to a step's
    norm: a record is counted once, however many optimizers read it and whether or not the
    step ends between them (identity, not an `id()` that a freed record's successor can
    take)."""

    params: frozenset[int]
    norm: Any
    counted: bool = False


class OptimizerGradientNorm:
    """Norm of the gradients of every optimizer that steps in a step, read at each one's
    step before the update (a single process with no DDP hook: `trainspec run -- python`)."""

    reads_after_unscale = True  # at the optimizer step: a GradScaler has unscaled them

    def __init__(self) -> None:
        self._squared: list[Any] = []  # this step's sums, on their devices
        self._fused: dict[int, Any] = {}  # id(optimizer) -> its FusedSquareSum
        self._read: set[int] = set()  # ids of the parameters this step's reads counted

    def capture(
        self,
        optimizer: Any,
        *,
        before_clip: dict[int, Any] | None = None,
        clips: Sequence[ClipRecord] = (),
    ) -> None:
        """Add `optimizer`'s gradient norm to the step's. `clips` are the step's L2
        `clip_grad_norm_` calls, (their parameters, their result: the norm before they
        clipped): each result counts once in the step, over what that clip covered (also
        parameters no stepping optimizer has), and the read leaves their parameters out.
        Of the rest, each parameter's norm as it was before another clip where
        `before_clip` has it (read now, after the clip, it would be the clip's bound), else
        as it is now. Nothing is read to the host here (`step_summary`)."""
        clipped = before_clip or {}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if clips:
            for record in clips:
                if not record.counted:
                    record.counted = True
                    self._read |= record.params
                    self._squared.append(record.norm.float().square())
            covered = frozenset().union(*(record.params for record in clips))
            params = [p for p in params if id(p) not in covered]
        self._read.update(map(id, params))
        if not clipped:
            fused = self._fused.get(id(optimizer))
            if fused is None:
                from trainspec.collector.fused_square_sum import FusedSquareSum

                fused = self._fused[id(optimizer)] = FusedSquareSum()
            self._squared += square_sums_of(params, fused)
            return
        now = gradient_norms(p for p in params if id(p) not in clipped)
        self._squared += squared_sums(
            [*now.values(), *(clipped[id(p)] for p in params if id(p) in clipped)]
        )

    def has_read(self, ids: set[int]) -> bool:
        """Whether a read since the last backward counted one of these parameters: a clip
        of them now would see gradients some optimizer has read (its result would count
        them twice), so its parameters are read one by one before it instead."""
        return not self._read.isdisjoint(ids)

    def new_gradients(self) -> None:
        """A backward begins: what was read before it were other gradients. (Reset here as
        well as at `step_summary`, which the zero-code layer sometimes calls only at the
        next optimizer step, after that step's clip.)"""
        self._read = set()

    def step_summary(self) -> DeferredNorm | None:
        self._read = set()
        if not self._squared:
            return None
        squared, self._squared = self._squared, []
        return DeferredNorm(HostValues(*squared))
