"""The compression hook under DDP's `join()` (uneven inputs): a rank whose data ran out runs
shadow backward passes, which train no sample (`_watch_join`); where DDP averages over the
ranks left (`divide_by_initial_world_size=False`) every bucket's sum is scaled to the mean over
the samples trained (`_scaled`), and the buckets before the last reach DDP through gates opened
once that factor is known (`_open_gates`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainspec.kernels.wire import as_error

# DDP's shadow backward under `join()` (torch's `_DDPJoinHook.main_hook` calls it)
SHADOW_PASS = "_match_all_reduce_for_bwd_pass"


class JoinHandling:
    """`CompressionHook`'s methods for DDP's join; the state they read is the hook's."""

    world_size: int
    stats_failures: int
    _shadow_next: bool
    _ddp: Callable[[], Any]

    def _watch_join(self, ddp_model: Any) -> None:
        """Mark DDP's shadow backward passes (`join()`: a rank whose data ran out sends zero
        gradients for each step the others still train) as this hook's: such a pass trained
        no sample, so it sends a share of 0 and nothing to the statistics' sums. Wraps the
        method on the instance, like `runtime.hook_wiring.watch_join` (which wraps this)."""
        original = getattr(ddp_model, SHADOW_PASS, None)
        if original is None:  # a torch without DDP's join
            return

        def shadow_pass(*args: Any, **kwargs: Any) -> Any:
            self._shadow_next = True
            try:
                return original(*args, **kwargs)
            finally:
                self._shadow_next = False

        vars(ddp_model)[SHADOW_PASS] = shadow_pass

    def _averages_over_trained(self) -> bool:
        """Whether this step's sum must be the mean over the samples trained when some rank
        sits it out: DDP's `join(divide_by_initial_world_size=False)`. With torch's default
        (True) DDP divides by the whole world, joined ranks' zeros included, so every sample
        weighs 1 / N whatever the step: the hook's n_r / N weights do that already."""
        ddp = self._ddp()
        config = getattr(ddp, "_join_config", None)
        if not getattr(config, "enable", False) or getattr(
            config, "throw_on_early_termination", False
        ):
            return False
        return getattr(ddp, "_divide_by_initial_world_size", True) is False

    def _scaled(
        self, scaling: _Scaling | None, totals: torch.Tensor, summed: torch.Tensor
    ) -> float:
        """Where DDP averages over the samples trained (`_averages_over_trained`): N / the
        samples the ranks trained this step (the sum of their n_r, in `totals`), by which
        the last bucket's `summed` is scaled here and the other buckets as their gates open;
        1.0 when every rank trained. Reads the totals on the host: on CUDA a wait for the
        step's last all-reduce, as DDP's own averaging over the ranks left waits for its
        count each step of such a join."""
        if scaling is None or not scaling.rescale:
            return 1.0
        try:
            values = totals.detach().to("cpu", torch.float64).tolist()
        except Exception:  # noqa: BLE001 - unread, the sum stays as the ranks sent it
            self.stats_failures += 1
            return 1.0
        aborted = round(values[3]) // (self.world_size + 1)
        trained = values[2]
        if aborted or not math.isfinite(trained) or not 0 < trained < scaling.total - 0.5:
            return 1.0
        scaling.factor = scaling.total / trained
        summed.mul_(scaling.factor)
        return scaling.factor


@dataclass
class _Scaling:
    """One step's scaling of its sum: `rescale` where DDP averages over the samples trained
    (`CompressionHook._averages_over_trained`), `total` the N its weights are of, `factor`
    what the sums were multiplied by once the statistics said (`CompressionHook._scaled`)."""

    rescale: bool
    total: int
    factor: float = 1.0


def _open_gates(
    gates: list[tuple[torch.futures.Future, torch.futures.Future]], factor: float
) -> None:
    """Hand DDP each bucket's sum (`done`) through its gate, scaled by `factor`; a bucket's
    error goes through as its own."""
    for done, gate in gates:
        try:
            value = done.wait()
            if factor != 1.0:
                value.mul_(factor)
        except BaseException as exc:  # noqa: BLE001 - raised for DDP from backward()
            gate.set_exception(as_error(exc))
            continue
        gate.set_result(value)
