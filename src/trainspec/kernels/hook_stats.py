"""The compression hook's per-step gradient statistics: the four floats each rank sends
([|g_r|^2, 1/n_r, n_r, flags], `_stats_scalars`), their all-reduce or their ride in the last
bucket's, publication once every bucket of the step is summed (`_finish_step`,
`_publish_both`, `_publish_carried`, `_defer`), and the summed totals read into
`GradientStats`, a void or non-finite step rolling error feedback back (`_apply`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainspec.host_copy import HostValues, single_float
from trainspec.kernels.codecs import Codec
from trainspec.kernels.hook_futures import _wait_for
from trainspec.kernels.hook_join import _Scaling
from trainspec.kernels.late_stats import Unpublished
from trainspec.kernels.residual_layout import Layout
from trainspec.kernels.stats import (
    GradientStats,
    NoiseScaleEMA,
    estimate_over_trained,
    nonnegative,
)
from trainspec.kernels.wire import Wire, WireRecord


class StepStatistics:
    """`CompressionHook`'s methods for its statistics; the state they read is the hook's."""

    world_size: int
    wire: Wire
    stats_failures: int
    loss_scale: Callable[[], Any] | None
    last_step_records: tuple[WireRecord, ...]
    _lock: threading.Lock
    _sum_lock: threading.Lock
    _settle_lock: threading.Lock
    _codecs: dict[str, Codec]
    _residuals: dict[int, tuple[Layout, torch.Tensor]]
    _consumed: dict[int, tuple[Layout, torch.Tensor]]
    _ema: NoiseScaleEMA
    _latest: GradientStats | None
    _unpublished: Unpublished | None
    _unsummarised: tuple[int, float]
    _poison: float
    _poisoned_step: int | None
    _last_bucket_ready: float | None
    _step_share: int
    _step_shadow: bool
    _step_local_batch: int | None
    _step_global_batch: int | None
    _t0: float
    _reduced_at: float
    _local_sq: torch.Tensor | float
    _bucket_sq: list[torch.Tensor]

    if TYPE_CHECKING:  # the hook's own (hook.py) and `JoinHandling`'s

        def settle(self) -> None: ...

        def _scaled(
            self, scaling: _Scaling | None, totals: torch.Tensor, summed: torch.Tensor
        ) -> float: ...

    def _stats_scalars(self, device: torch.device) -> torch.Tensor:
        """[|g_r|^2, 1/n_r, n_r, flags] in float64, summed over ranks in an all-reduce of their
        own or (cast to float32) carried in the last bucket's. flags is 1 if this rank trained
        samples this pass (n_r > 0), plus W + 1 if it aborted the step (`abort_step`):
        summed, the count stays below W + 1, so both read back exactly (`_apply`).

        A rank that trained nothing this pass sends n_r = 0 and nothing to the sums: a shadow
        pass of DDP's join (its data ran out; it sends zero gradients while the others train),
        or a share of 0 from the actuator. The estimate is then made over the ranks that
        trained (QA 2026-11-28: a joined rank counted as one with |g|^2 = 0 and a share made
        the variance 0.45x the two trained ranks' own). Where n_r is unknown (no `set_shares`)
        the rank counts with n_r = 1 of W, as its weight says, and sends NaN for |g_r|^2: no
        estimate. The two flags are packed in one float. (2026-11-25: a 4-float all-reduce
        once seemed to abort a 4-rank gloo test job, "terminate called without an active
        exception"; that came from a test worker that skipped the exit clean-up of
        kernels/teardown.py, 3 aborts in 46 runs, none in 60 with it; n_r rides as a fourth
        float since 2026-11-28.) A rank whose gradient
        held a NaN or an infinity (its |g_r|^2, in float64, is not finite: `squared_norm`)
        sends an infinity for 1/n_r, so the sum tells every rank the step was not finite
        (`_apply`). |g_r|^2 cannot tell it: carried in float32, a finite |g_r|^2 above 3.4e38
        reads back as infinite too. Such a step makes no noise estimate anyway."""
        share = self._step_share
        known = self._step_shadow or self._step_local_batch is not None
        inv_local = 1.0 / share if share > 0 else 0.0
        flag = (1.0 if share > 0 else 0.0) + self._poison * (self.world_size + 1)
        # Made on the device from Python numbers (fills, no copy): NCCL reduces device
        # tensors only, and a host tensor copied over waits for the stream on CUDA.
        local_sq = self._local_sq
        if not isinstance(local_sq, torch.Tensor):
            local_sq = torch.full((), local_sq, dtype=torch.float64, device=device)
        local_sq = local_sq.to(device=device, dtype=torch.float64).reshape(())
        inv = torch.full((), inv_local, dtype=torch.float64, device=device)
        sent_sq = local_sq
        if not known or share == 0:
            sent_sq = torch.full((), 0.0 if known else math.nan, dtype=torch.float64, device=device)
        return torch.stack([
            sent_sq,
            torch.where(torch.isfinite(local_sq), inv, math.inf),  # on the device: no sync
            torch.full((), float(share), dtype=torch.float64, device=device),
            torch.full((), flag, dtype=torch.float64, device=device),
        ])  # fmt: skip

    def _finish_step(
        self,
        summed: torch.Tensor,
        step: int,
        level: str,
        ready: Any = None,
        scaling: _Scaling | None = None,
    ) -> torch.futures.Future:
        _wait_for(ready, summed.device)  # the step's local squared norm, queued in backward
        allreduce_s = time.perf_counter() - self._t0
        scalars = self._stats_scalars(summed.device)

        def publish(totals: torch.Tensor) -> torch.Tensor:
            factor = self._scaled(scaling, totals, summed)
            self._defer(step, level, totals, allreduce_s, factor)
            return summed

        return self.wire.all_reduce(scalars, then=publish)

    def _publish_both(
        self,
        futs: list[torch.futures.Future],
        step: int,
        level: str,
        scaling: _Scaling | None = None,
    ) -> torch.Tensor:
        """The last bucket's sum (its error raised for DDP), after publishing the statistics
        (`futs`: every bucket of the step in order, then the statistics' all-reduce). Read
        with `wait`, which on CUDA makes this stream wait for them (`collect_all` makes a CPU
        future; the value is handed on in a device future, `follow`)."""
        for fut in futs[:-2]:  # on CUDA: this stream waits for every bucket's sum
            fut.wait()
        summed = futs[-2].wait()
        totals = futs[-1].wait()
        factor = self._scaled(scaling, totals, summed)
        self._defer(step, level, totals, self._reduced_at - self._t0, factor)
        return summed

    def _publish_carried(
        self,
        futs: list[torch.futures.Future],
        carried: list[torch.Tensor],
        step: int,
        level: str,
        scaling: _Scaling | None = None,
    ) -> torch.Tensor:
        """The last bucket's sum (its error raised for DDP), after publishing the statistics
        it carried (`futs`: every bucket of the step in order, the last one last; read with
        `wait`, as in `_publish_both`)."""
        for fut in futs[:-1]:  # on CUDA: this stream waits for every bucket's sum
            fut.wait()
        summed = futs[-1].wait()
        factor = self._scaled(scaling, carried[0], summed)
        self._defer(step, level, carried[0], self._reduced_at - self._t0, factor)
        return summed

    def _defer(
        self,
        step: int,
        level: str,
        totals: torch.Tensor,
        allreduce_s: float,
        applied_factor: float = 1.0,
    ) -> None:
        """The backward's totals on their way to the host (late_stats.py); computed here at
        once where they are there already (the CPU). Never raises: a failure to compute
        statistics loses the statistics, not the step."""
        self.last_step_records = records = tuple(self.wire.records)
        try:
            with self._sum_lock:
                squares = list(self._bucket_sq)
            global_sq = torch.stack(squares).sum() if squares else 0.0
            values = HostValues(totals, global_sq, self._local_sq)
            scale = self.loss_scale() if self.loss_scale is not None else None
        except Exception:  # noqa: BLE001 - statistics must never fail the step
            self.stats_failures += 1
            return
        # A shadow pass spent no residual and kept none: a void step leaves them all.
        with self._lock:
            consumed = dict(self._residuals if self._step_shadow else self._consumed)
        pending = Unpublished(
            step=step,
            level=level,
            values=values,
            scale=scale,
            allreduce_s=allreduce_s,
            records=records,
            global_batch=self._step_global_batch,
            last_bucket_ready=self._last_bucket_ready,
            consumed=consumed,
            applied_factor=applied_factor,
        )
        self.settle()  # a backward before this one, in flight still (none in practice)
        with self._settle_lock:
            self._unpublished = pending
        if values.ready():
            self.settle()

    def _apply(self, pending: Unpublished, values: list[float]) -> None:
        totals, (big_sq, local_sq) = values[:4], values[4:6]
        w = self.world_size
        aborted, trained_ranks = divmod(round(totals[3]), w + 1)
        if aborted:  # a rank aborted this step: its sums are void, and so are its stats
            self._poisoned_step = pending.step
            pending.held_terms = self._ema.terms()
            # Error feedback as before the step: what it consumed is owed again, what it set
            # is void (local state: each rank restores its own). Codec state (warm starts)
            # moved alike on every rank and stays.
            with self._lock:
                self._residuals = dict(pending.consumed)
                if pending.summary is not None:  # the passes before it go to the next summary
                    nbytes, seconds = self._unsummarised
                    taken_bytes, taken_seconds = pending.summary.taken
                    self._unsummarised = (nbytes + taken_bytes, seconds + taken_seconds)
            return
        # Some rank's gradient was not finite (`_stats_scalars`), whatever |g_r|^2 came to.
        finite = math.isfinite(totals[1])
        if not finite:
            self._forget_nonfinite_step(pending)
        est = None
        # Over the ranks that trained samples this step (a rank in DDP's join sent n_r = 0
        # and nothing to the sums: `_stats_scalars`). One rank has one batch size: no
        # estimate, not left to the gap of the inverses being 0 (carried in float32, 1/n_r
        # reads back as float32(1/n_r), not 1/N).
        if finite and pending.global_batch:
            est = estimate_over_trained(
                totals[0], totals[1], trained_ranks, totals[2], big_sq, pending.global_batch
            )
        if est is not None:
            noise = self._ema.update(est, _scale_number(pending.scale))
        else:
            noise = self._ema.value()
        comm_bytes = sum(r.sent_bytes for r in pending.records)
        with self._lock:
            if pending.summary is not None:  # handed out already: the bytes go with it
                pending.summary.add(comm_bytes, pending.allreduce_s)
            else:
                nbytes, seconds = self._unsummarised
                self._unsummarised = (nbytes + comm_bytes, seconds + pending.allreduce_s)
        pending.result = self._latest = GradientStats(
            step=pending.step,
            level=pending.level,
            grad_norm=math.sqrt(big_sq) * pending.applied_factor,
            grad_variance=nonnegative(est.trace_cov) if est is not None else None,
            grad_noise_scale=noise,
            comm_bytes=comm_bytes,
            allreduce_s=pending.allreduce_s,
            local_grad_norm=math.sqrt(local_sq),
            world_size=w,
            global_batch=pending.global_batch,
            last_bucket_ready=pending.last_bucket_ready,
            noise_terms=self._ema.terms(),
        )
        pending.held_terms = pending.result.noise_terms

    def _forget_nonfinite_step(self, pending: Unpublished) -> None:
        """Some rank's gradient held a NaN or infinity (the sum of the ranks' 1/n_r is not
        finite, alike on every rank: `_stats_scalars`): the residuals this step left hold them
        too, and would carry them into every later step (at int8 the rank's gradient was then
        lost for good; at lowrank every later sum was NaN). Error feedback goes back to where it
        stood before the step, as when a step is void, and the codec's own state (lowrank's
        warm-started Q) starts afresh on every rank alike. The step's own result is not
        finite either (int8 carries a NaN scale), so a GradScaler skips it as with `none`."""
        with self._lock:
            self._residuals = dict(pending.consumed)
            codec = self._codecs.get(pending.level)
            if codec is not None:
                codec.forget_warm_starts()


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _past_float32(grad: torch.Tensor, weight: float, sq: torch.Tensor) -> torch.Tensor:
    """`sq`, or an infinity when the float64 bucket `grad` holds a value the codec's float32
    encoding (`weighted`: converted first, then weighted) turns into one; weighted, a
    value can only grow past it (a weight above 1), never come back under it (a review
    found the weight of a rank of two, 0.5, let values up to 6.8e38 through). The step is then not finite on
    every rank (`_stats_scalars`) and its error feedback is rolled back: before, a finite
    float64 gradient past 3.4e38 counted as finite while int8's and lowrank's residuals
    turned NaN and topk's kept an infinity, every later step's sum with them (QA
    2026-11-28). One more read of a float64 bucket, at a lossy level only; on the device,
    no wait."""
    over = grad.abs().amax() * max(1.0, abs(weight)) > _FLOAT32_MAX
    return torch.where(over, torch.full_like(sq, math.inf), sq)


def _scale_number(scale: Any) -> float | None:
    """A loss scale as the EMA takes it: a positive finite number, else None."""
    number = single_float(scale) if isinstance(scale, HostValues) else scale
    if not isinstance(number, (int, float)) or not 0 < number < math.inf:
        return None
    return float(number)
