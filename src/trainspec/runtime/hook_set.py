"""Several DDP models in one job (a GAN, an actor and a critic): one gradient hook each,
driven as one.

Every control call reaches every hook, so a level switch, uneven shares or restored error
feedback apply to all models at once, as they do to one (each hook takes back only the
error-feedback pieces of its own model's parameters).  The level it reports is the first
model's: a switch lands on each model at its own next backward, and in between the models
may differ for a moment; the step rows say what each step ran. A step's statistics combine the
models' fresh ones when first read (on CUDA they may still be in flight): squared norms, the
variance estimate (tr(Sigma)) and the noise-scale terms all add over disjoint sets of
parameters, so the combined figures are those of the concatenated gradient (the noise scale
is the ratio of the summed smoothed terms, McCandlish et al. 2018, appendix A, applied to the
whole parameter vector).

Each hook counts its own backward passes (a discriminator's may run twice a step), so a
switch asked for at the set's step `k` is applied at each hook's own step `k - set.step`
ahead. Aborting a step part-way (out of memory) concerns one model's exchange, and is asked
of that model's own hook (`accumulate.MicroBatchRunner`), never of the set.
"""

from __future__ import annotations

import math
from typing import Any

from trainspec.collector.gradients import GradientSummary
from trainspec.kernels.late_stats import LateFigures
from trainspec.kernels.stats import nonnegative


class HookSet:
    """The `CompressionHook` control surface over two or more hooks (in wrapping order),
    each with the ids of its model's parameters (`id(p)`, the keys of error feedback)."""

    def __init__(self, hooks: list[Any], parameter_ids: list[set[int]]) -> None:
        if len(hooks) < 2 or len(parameter_ids) != len(hooks):
            raise ValueError(
                f"a HookSet drives two or more hooks, each with its parameters' ids; got "
                f"{len(hooks)} hooks and {len(parameter_ids)} sets of ids"
            )
        self.hooks = list(hooks)
        self._ids = [set(ids) for ids in parameter_ids]

    # ----- control: every hook alike -----

    @property
    def level(self) -> str:
        """The first model's level (the actuator's ladder reads one level, not a pair)."""
        return str(self.hooks[0].level)

    @property
    def next_level(self) -> str:
        return str(self.hooks[0].next_level)

    @property
    def step(self) -> int:
        """The first model's next step: the clock `set_level(at_step=)` counts in."""
        return int(self.hooks[0].step)

    def set_level(
        self, level: str, at_step: int | None = None, *, reset_error_feedback: bool = False
    ) -> None:
        ahead = None if at_step is None else at_step - self.step
        if ahead is not None and ahead < 0:
            raise ValueError(f"cannot switch level at step {at_step}: step {self.step} is next")
        for hook in self.hooks:  # the first refuses a bad level before any hook switches
            at = None if ahead is None else hook.step + ahead
            hook.set_level(level, at, reset_error_feedback=reset_error_feedback)

    def set_shares(self, local_samples: int, global_samples: int) -> None:
        for hook in self.hooks:
            hook.set_shares(local_samples, global_samples)

    def error_feedback(self) -> dict[int, Any]:
        """Every model's residuals, one piece per parameter (keys are id(parameter))."""
        pieces: dict[int, Any] = {}
        for hook, ids in zip(self.hooks, self._ids, strict=True):
            pieces.update((k, v) for k, v in hook.error_feedback().items() if k in ids)
        return pieces

    def restore_error_feedback(self, pieces: dict[int, Any]) -> None:
        """Each hook takes back the pieces of its own parameters; a model none of whose
        parameters has a piece keeps its error feedback as it is (the pieces came from a
        checkpoint of another model, `actuate`'s)."""
        for hook, ids in zip(self.hooks, self._ids, strict=True):
            own = {k: v for k, v in pieces.items() if k in ids}
            if own or not pieces:
                hook.restore_error_feedback(own)

    # ----- statistics -----

    def step_summary(self) -> CombinedStats | None:
        """The models' statistics since the last call, combined when first read; None when
        no model ran a backward since. Nothing is read here: on CUDA a model's totals may
        still be on their way to the host (`LateStats`), and reading them would wait for
        its last all-reduce."""
        fresh: list[Any] = []
        held: list[Any] = []  # the noise terms of the models without a fresh backward
        for hook in self.hooks:
            summary = hook.step_summary()
            if summary is not None:
                fresh.append(summary)
            else:  # its terms, or the step in flight that will have them
                held.append(hook.held_noise_terms())
        return CombinedStats(fresh, held) if fresh else None


class CombinedStats(LateFigures):
    """One step's statistics of several models, combined at the first read (and `ready()`
    once every model's are). Squared norms, the variance estimate (tr(Sigma)) and the
    noise-scale terms add over disjoint sets of parameters; a model whose step was void
    (some rank aborted it) counts as one that ran no backward. The noise scale needs every
    model's terms: this step's for a model that ran one, those it held for the rest."""

    def __init__(self, fresh: list[Any], held: list[Any]) -> None:
        self._fresh = fresh
        self._held = held  # (tr, |G|^2), None, or a `LateStats` whose step is in flight
        self._combined: GradientSummary | None = None
        self._computed = False

    def ready(self) -> bool:
        parts = [*self._fresh, *self._held]
        return all(getattr(p, "ready", lambda: True)() for p in parts)

    def figure(self, name: str) -> Any:
        if not self._computed:
            self._combined, self._computed = self._combine(), True
        return None if self._combined is None else getattr(self._combined, name)

    def _combine(self) -> GradientSummary | None:
        valid = [s for s in self._fresh if s.grad_norm is not None]
        if not valid:
            return None
        variances = [s.grad_variance for s in valid if s.grad_variance is not None]
        ready = [s.last_bucket_ready for s in valid if s.last_bucket_ready is not None]
        held = [t.noise_terms if hasattr(t, "noise_terms") else t for t in self._held]
        return GradientSummary(
            grad_norm=math.sqrt(sum(s.grad_norm**2 for s in valid)),
            grad_variance=math.fsum(variances) if len(variances) == len(valid) else None,
            grad_noise_scale=_noise_scale([s.noise_terms for s in self._fresh] + held),
            comm_bytes=sum(s.comm_bytes for s in valid),
            allreduce_s=sum(s.allreduce_s for s in valid),
            last_bucket_ready=max(ready) if ready else None,
            compression=_joined(s.compression for s in valid),
        )


def _noise_scale(terms: list[tuple[float, float] | None]) -> float | None:
    """B_simple of the concatenated gradient: summed smoothed tr(Sigma) over summed |G|^2
    (McCandlish et al. 2018, appendix A); None unless every model has an estimate."""
    if any(t is None for t in terms):
        return None
    trace = math.fsum(t[0] for t in terms if t is not None)
    grad_sq = math.fsum(t[1] for t in terms if t is not None)
    return nonnegative(trace / grad_sq) if grad_sq > 0 else None


def _joined(levels: Any) -> str:
    """One level when every model runs it, else each model's in order, joined by '+'."""
    names = list(levels)
    return names[0] if len(set(names)) == 1 else "+".join(names)
