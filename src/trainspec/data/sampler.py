"""A distributed batch sampler whose per-rank shares of the global batch can change between steps.

Every epoch is one seeded permutation of all indices. Each step takes the next N indices of it
(the global batch) and hands rank r a contiguous slice of n_r of them, sum(n_r) = N. The slices
are cut from the same permutation on every rank, so whatever the shares, an epoch covers every
index exactly once: nothing dropped, nothing repeated. The last step of an epoch carries the
remainder (fewer than N), split in proportion to the shares. This is what lets the actuator
rebalance work between ranks (`set_shares`) without touching convergence maths, and what lets a
resumed job continue with the same data order (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

STATE_KEYS = ("dataset_len", "global_batch", "world_size", "seed", "epoch", "position", "shares")


class SamplerStateError(ValueError):
    """A sampler state dict that does not fit this sampler (other dataset, batch or world size)."""


@dataclass(frozen=True)
class StepBatch:
    """One step's plan: this rank's sample indices and where they sit in the global batch."""

    epoch: int
    step_in_epoch: int
    indices: list[int]
    global_count: int  # samples in this step over all ranks (N, or the epoch's remainder)
    shares: tuple[int, ...]  # samples per rank in this step; sums to global_count


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split `total` into integers proportional to `weights` (largest remainder, ties to low rank)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        raise ValueError(f"weights must have a positive sum, got {list(weights)}")
    exact = [total * w / weight_sum for w in weights]
    parts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _whole_number(name: str, value: object) -> int:
    """An int, or anything with `__index__` (a NumPy integer); not a bool, float or string."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a whole number, not a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be a whole number, not {type(value).__name__} {value!r}"
        ) from None


class ShareBatchSampler:
    """Yields this rank's indices step by step; shares of the global batch may change per step.

    `next_step()` returns a `StepBatch` and advances the position; `state_dict()` describes the
    position after the last batch handed out. Used as a DataLoader `batch_sampler`, iteration
    yields index lists until the end of the current epoch; keep `num_workers=0` (or call
    `next_step()` yourself) if the state must match what was trained on, since worker prefetch
    draws batches ahead of the training loop.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shares: Sequence[int] | None = None,
    ) -> None:
        dataset_len, global_batch, rank, world_size, seed = (
            _whole_number(name, value)
            for name, value in (
                ("dataset_len", dataset_len),
                ("global_batch", global_batch),
                ("rank", rank),
                ("world_size", world_size),
                ("seed", seed),
            )
        )
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, got {dataset_len}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if global_batch < world_size:
            raise ValueError(f"global_batch {global_batch} is smaller than world_size {world_size}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if global_batch > dataset_len:
            raise ValueError(
                f"global_batch {global_batch} is larger than dataset_len {dataset_len}: "
                "no step would ever carry a whole global batch"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # indices of the current epoch's permutation already handed out
        self._shares = self._checked(shares) if shares is not None else self.equal_shares()
        self._perm: list[int] | None = None

    def equal_shares(self) -> tuple[int, ...]:
        return tuple(apportion(self.global_batch, [1] * self.world_size))

    @property
    def shares(self) -> tuple[int, ...]:
        return self._shares

    def set_shares(self, shares: Sequence[int]) -> None:
        """Use these per-rank sample counts from the next step on (every rank must call alike)."""
        self._shares = self._checked(shares)

    def _checked(self, shares: Sequence[int]) -> tuple[int, ...]:
        values = tuple(int(s) for s in shares)
        if len(values) != self.world_size:
            raise ValueError(
                f"shares {list(values)} must have one entry per rank ({self.world_size})"
            )
        if any(s < 0 for s in values) or any(
            s != orig for s, orig in zip(values, shares, strict=True)
        ):
            raise ValueError(f"shares {list(shares)} must be non-negative integers")
        if sum(values) != self.global_batch:
            raise ValueError(
                f"shares {list(values)} sum to {sum(values)}, not the global batch {self.global_batch}"
            )
        return values

    def steps_per_epoch(self) -> int:
        return -(-self.dataset_len // self.global_batch)

    def __len__(self) -> int:
        return self.steps_per_epoch()

    def _permutation(self) -> list[int]:
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.dataset_len, generator=gen).tolist()
        return self._perm

    def next_step(self) -> StepBatch:
        """This rank's indices for the next step; rolls into the next epoch when one is done."""
        if self.position >= self.dataset_len:
            self._start_next_epoch()
        perm = self._permutation()
        count = min(self.global_batch, self.dataset_len - self.position)
        shares = (
            self._shares if count == self.global_batch else tuple(apportion(count, self._shares))
        )
        start = self.position + sum(shares[: self.rank])
        batch = StepBatch(
            epoch=self.epoch,
            step_in_epoch=self.position // self.global_batch,
            indices=perm[start : start + shares[self.rank]],
            global_count=count,
            shares=shares,
        )
        self.position += count
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's index lists until the end of the current epoch."""
        if self.position >= self.dataset_len:
            self._start_next_epoch()
        while self.position < self.dataset_len:
            yield self.next_step().indices

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._perm = None

    def state_dict(self) -> dict[str, int | list[int]]:
        return {
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "shares": list(self._shares),
        }

    def check_state_dict(self, state: object) -> None:
        """Raise SamplerStateError unless `load_state_dict(state)` would take `state`: one
        from another dataset, global batch, world size or seed, or one that is malformed.
        Changes nothing, so a resume can refuse a checkpoint before loading any of it."""
        if not isinstance(state, dict):
            raise SamplerStateError(f"sampler state must be a dict, not {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise SamplerStateError(f"sampler state lacks {', '.join(missing)}")
        for key in ("dataset_len", "global_batch", "world_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise SamplerStateError(
                    f"sampler state has {key}={state.get(key)!r}, this sampler has {getattr(self, key)!r}"
                )
        try:
            position, epoch = int(state["position"]), int(state["epoch"])
            self._checked(state["shares"])
        except (TypeError, ValueError) as exc:
            raise SamplerStateError(f"sampler state: {exc}") from None
        if not 0 <= position <= self.dataset_len:
            raise SamplerStateError(
                f"sampler state position {position} outside 0..{self.dataset_len}"
            )
        if epoch < 0:
            raise SamplerStateError(f"sampler state epoch {epoch} is negative")

    def load_state_dict(self, state: dict[str, int | list[int]]) -> None:
        """Continue exactly where `state` left off; refuses a state from another configuration
        (SamplerStateError, `check_state_dict`)."""
        self.check_state_dict(state)
        self._shares = self._checked(state["shares"])  # type: ignore[arg-type]
        self.epoch = int(state["epoch"])  # type: ignore[arg-type]
        self.position = int(state["position"])  # type: ignore[arg-type]
        self._perm = None
