"""The micro-batch plan: a rank's step share cut into micro-batches for gradient accumulation.

A rank's share of n_r samples is run as ceil(n_r / m) micro-batches of at most m samples,
the gradients accumulated (DDP `no_sync()` on all but the last), each micro-batch's mean
loss weighted by its size / n_r, so the accumulated gradient is the share's own gradient
and the hook's n_r / N weighting still makes the update the full-batch gradient. The limit
m is what the memory policy halves under pressure and what an OOM retry halves locally
(gradient accumulation trades activation memory for time at a constant batch: Chen et al.,
"Training deep nets with sublinear memory cost", 2016, sec. 1; the same global batch keeps
the optimisation unchanged, Goyal et al., "Accurate, large minibatch SGD", 2017, sec. 2).

`limit == 0` means the whole share in one micro-batch: no accumulation, today's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE_SHARE = 0


@dataclass(frozen=True)
class MicroBatch:
    """Positions [start, stop) in the rank's share and the weight of its mean loss."""

    start: int
    stop: int
    weight: float  # size / n_r: the accumulated gradient is the share's mean gradient
    last: bool  # the one micro-batch whose backward communicates (outside no_sync)

    @property
    def size(self) -> int:
        return self.stop - self.start


def split_share(n: int, limit: int) -> list[MicroBatch]:
    """Cut n samples into ceil(n / limit) micro-batches as even as possible (sizes differ by at
    most one), so the peak is ceil(n / k) rather than a full `limit` and a short tail.

    An empty share is one micro-batch over one placeholder sample with weight 0: every rank
    must still run a backward so DDP's all-reduce happens on all of them.
    """
    if n < 0 or limit < 0:
        raise ValueError(f"share {n} and micro-batch limit {limit} must be non-negative")
    if n == 0:
        return [MicroBatch(0, 1, 0.0, True)]
    count = 1 if limit == WHOLE_SHARE else -(-n // limit)
    base, extra = divmod(n, count)
    out: list[MicroBatch] = []
    start = 0
    for k in range(count):
        size = base + (1 if k < extra else 0)
        out.append(MicroBatch(start, start + size, size / n, k == count - 1))
        start += size
    return out


def accumulation_steps(n: int, limit: int) -> int:
    return 1 if limit == WHOLE_SHARE or n <= limit else -(-n // limit)


def effective(limit: int, n: int) -> int:
    """The largest micro-batch a share of n runs under `limit` (n itself for the whole share)."""
    return n if limit == WHOLE_SHARE else min(limit, n)


def largest_micro_batch(n: int, limit: int) -> int:
    """The largest micro-batch `split_share(n, limit)` runs (0 for an empty share: its one
    placeholder sample is no micro-batch of the share's)."""
    if n <= 0:
        return 0
    count = 1 if limit == WHOLE_SHARE else -(-n // limit)
    return -(-n // count)


def halved(limit: int, largest_share: int, minimum: int) -> int:
    """Half the micro-batch now in use (the largest share when it is the whole share), not
    below `minimum`; returns `limit` unchanged when it cannot go lower."""
    current = effective(limit, largest_share)
    return max(minimum, current // 2) if current > minimum else limit


class MicroBatchPlan:
    """This rank's micro-batch limit: starts at `configured`, moved by the memory policy (every
    rank alike) or by an OOM retry (this rank alone, reconciled at the next window)."""

    def __init__(self, configured: int = WHOLE_SHARE, minimum: int = 1) -> None:
        if minimum < 1:
            raise ValueError(f"actuator.min_micro_batch must be at least 1, got {minimum}")
        if configured < 0:
            raise ValueError(
                f"actuator.micro_batch must be 0 (whole share) or more, got {configured}"
            )
        if configured != WHOLE_SHARE and configured < minimum:
            raise ValueError(
                f"actuator.micro_batch {configured} is below actuator.min_micro_batch {minimum}"
            )
        self.configured = configured
        self.minimum = minimum
        self.limit = configured
        self.oom_at = 0  # smallest micro-batch that raised an OOM on this rank (0: none)

    def split(self, n: int) -> list[MicroBatch]:
        """The share of n as micro-batches under the limit, each below `oom_at` whatever the
        limit says (a whole share the rebalance grew, a limit restored from an older save)."""
        return split_share(n, self.bounded_limit(n))

    def bounded_limit(self, n: int) -> int:
        """The limit a share of n runs under: `limit`, capped below the smallest micro-batch
        that ran out of memory on this rank (never below `minimum`)."""
        if self.oom_at == 0 or effective(self.limit, n) < self.oom_at:
            return self.limit
        return max(self.minimum, self.oom_at - 1)

    def set_limit(self, limit: int) -> None:
        """Use `limit` (0: whole share) from the next step; raises ValueError below the minimum."""
        if limit != WHOLE_SHARE and limit < self.minimum:
            raise ValueError(f"micro-batch {limit} is below the minimum {self.minimum}")
        self.limit = int(limit)

    def shrink_after_oom(self, failed_size: int) -> bool:
        """Halve below the micro-batch that failed; False when already at the minimum."""
        self.oom_at = failed_size if self.oom_at == 0 else min(self.oom_at, failed_size)
        if failed_size <= self.minimum:
            return False
        self.limit = max(self.minimum, failed_size // 2)
        return True
