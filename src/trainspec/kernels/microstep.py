"""The hook's statistics in one process, across gradient-accumulation micro-steps.

Micro-step k's gradient plays the part of rank k's: |g_k|^2 averaged over micro-steps is
the small-batch norm and |mean_k g_k|^2 the big-batch one (McCandlish et al. 2018, app. A).
Call `observe` after each micro-step's backward; it takes the increment of `.grad` since the
previous call (so it keeps one copy of the gradients), and `finish_step` returns the
step's `GradientStats` and starts the next step. Nothing is read to the host until then, and
not even then when the step is ended with `take_step` and its squares read later
(`stats_of`): the session does that without a device synchronization.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trainspec.kernels.stats import GradientStats, NoiseScaleEMA, estimate_noise, nonnegative


class MicroStepStats:
    """`loss_divided_by_steps`: True when each micro-step's loss was divided by the number
    of micro-steps (so `.grad` ends as the mean), False when `.grad` ends as the sum."""

    def __init__(
        self, micro_batch_size: int, *, loss_divided_by_steps: bool = True, ema_decay: float = 0.9
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.loss_divided_by_steps = loss_divided_by_steps
        self._ema = NoiseScaleEMA(ema_decay)
        self._step = 0
        self._begin_step()

    def _begin_step(self) -> None:
        self._previous: list[torch.Tensor] | None = None
        # per micro-step, per device: a 0-d float64 sum of squares, left on that device
        self._delta_sq: list[dict[torch.device, torch.Tensor]] = []
        self._total: list[torch.Tensor] | None = None

    def observe(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        grads = [p.grad.detach().to(torch.float32) for p in parameters if p.grad is not None]
        if not grads:
            raise ValueError("observe() found no parameter with a gradient")
        if self._previous is None:
            deltas = grads
        else:
            deltas = [g - prev for g, prev in zip(grads, self._previous, strict=True)]
        self._delta_sq.append(_squared_sums(deltas))
        self._previous = [g.clone() for g in grads]
        self._total = self._previous

    def take_step(self) -> list[torch.Tensor]:
        """End the step without reading anything to the host: its squared norms, one float64
        tensor [|delta_1|^2, ..., |delta_K|^2, |total|^2] per device the gradients are on,
        left there (no copy between devices), for `stats_of(combine(...))` once they are
        read (`trainspec.host_copy`)."""
        if not self._delta_sq or self._total is None:
            raise RuntimeError("finish_step() called before any observe()")
        totals = _squared_sums(self._total)
        squares = [
            torch.stack([*(step[device] for step in self._delta_sq), total])
            for device, total in totals.items()
        ]
        self._begin_step()
        return squares

    @staticmethod
    def combine(per_device: list[list[float]]) -> list[float]:
        """`take_step`'s tensors, read to the host, as one list: summed over devices."""
        return [sum(values) for values in zip(*per_device, strict=True)]

    def stats_of(self, squares: list[float], loss_scale: float | None = None) -> GradientStats:
        """The statistics of the next step `take_step` ended, from its squares read to the
        host (in the order steps were taken: the noise-scale EMA moves here). `loss_scale`:
        the GradScaler scale the gradients carry, which keeps the EMA in their own units."""
        *delta_sq, total_sq = squares
        k = len(delta_sq)
        if self.loss_divided_by_steps:  # delta_k = g_k / K, total = mean g
            small_sq = k * k * sum(delta_sq) / k
            big_sq = total_sq
        else:  # delta_k = g_k, total = sum g
            small_sq = sum(delta_sq) / k
            big_sq = total_sq / (k * k)
        b = self.micro_batch_size
        est = estimate_noise(small_sq, big_sq, 1.0 / b, 1.0 / (b * k)) if k > 1 else None
        noise = self._ema.update(est, loss_scale) if est is not None else self._ema.value()
        stats = GradientStats(
            step=self._step,
            level="none",
            grad_norm=big_sq**0.5,
            grad_variance=nonnegative(est.trace_cov) if est is not None else None,
            grad_noise_scale=noise,
            comm_bytes=0,
            allreduce_s=0.0,
            local_grad_norm=small_sq**0.5,
            world_size=1,
            global_batch=b * k,
        )
        self._step += 1
        return stats

    def finish_step(self, loss_scale: float | None = None) -> GradientStats:
        """`take_step` and `stats_of` at once: the step's statistics now (on CUDA this reads
        the squares to the host, a device synchronization)."""
        per_device = [t.tolist() for t in self.take_step()]
        return self.stats_of(self.combine(per_device), loss_scale)


def _squared_sums(tensors: list[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """sum |t|^2 over `tensors`, per device: a float64 0-d tensor on each."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return {
        device: torch.stack(torch._foreach_norm(ts)).double().square().sum()
        for device, ts in by_device.items()
    }
