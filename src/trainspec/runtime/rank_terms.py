"""What every rank of a job must agree on, settled at `init` in one gather on the control group.

A setting given to one rank only (its own environment, a per-node config file) that changes
what crosses the wire made the job abort in its first backward: with the collector off on
rank 1, rank 0's gradient hook carried its statistics in the last bucket and rank 1's plain
DDP did not (gloo: "Received data size doesn't match expected size"); a compression level
given to one rank did the same. The terms:

- the run id and the gradient hook's wire settings (`kernels.compression`,
  `kernels.int8_block_size`): rank 0's on every rank, with a warning on a rank that differed;
- the gradient hook itself: on every rank where the collector is on on any (a rank whose
  collector is off still runs the hook, so its collectives match, and stores nothing);
- the latency probe: on only where every rank probes (a probe is an all-reduce; the others'
  waited for a rank that never sent one, each until its timeout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from trainspec.config import TrainspecConfig

log = logging.getLogger("trainspec.runtime")


@dataclass(frozen=True)
class Terms:
    """One rank's side of the agreement; after `agree`, the job's."""

    run_id: str
    collector: bool  # this rank collects (`collector.enabled`)
    probe: bool  # this rank would probe (`collector.enabled` and `collector.probe`)
    compression: str
    int8_block_size: int

    @classmethod
    def of(cls, cfg: TrainspecConfig, run_id: str) -> Terms:
        on = bool(cfg.collector.enabled)
        return cls(
            run_id=run_id,
            collector=on,
            probe=on and bool(cfg.collector.probe),
            compression=str(cfg.kernels.compression),
            int8_block_size=int(cfg.kernels.int8_block_size),
        )

    def as_wire(self) -> tuple[str, bool, bool, str, int]:
        """Plain values for the gather (no class of ours in another rank's pickle)."""
        return (self.run_id, self.collector, self.probe, self.compression, self.int8_block_size)


@dataclass(frozen=True)
class Agreement:
    """The job's terms: `hook` says whether trainspec's gradient hook goes on DDP models."""

    run_id: str
    hook: bool
    probe: bool
    compression: str
    int8_block_size: int

    @classmethod
    def alone(cls, mine: Terms) -> Agreement:
        """A rank with no one to agree with (not distributed): its own terms."""
        return cls(mine.run_id, mine.collector, mine.probe, mine.compression,
                   mine.int8_block_size)  # fmt: skip

    def applied_to(self, cfg: TrainspecConfig) -> TrainspecConfig:
        """`cfg` with the agreed probe and hook settings (a copy: the caller's is untouched)."""
        collector = replace(cfg.collector, probe=cfg.collector.probe and self.probe)
        kernels = replace(
            cfg.kernels, compression=self.compression, int8_block_size=self.int8_block_size
        )
        return replace(cfg, collector=collector, kernels=kernels)


def settle(votes: list[tuple[str, bool, bool, str, int]], rank: int) -> Agreement:
    """The agreement from every rank's `Terms.as_wire()` (in rank order), with the warnings
    this rank owes: a term of its own that lost to rank 0's, a part that is on here but not
    everywhere."""
    terms = [Terms(*vote) for vote in votes]
    first, mine = terms[0], terms[rank]
    deal = Agreement(
        run_id=first.run_id,
        hook=any(t.collector for t in terms),
        probe=all(t.probe for t in terms),
        compression=first.compression,
        int8_block_size=first.int8_block_size,
    )
    if (mine.compression, mine.int8_block_size) != (deal.compression, deal.int8_block_size):
        log.warning(
            "trainspec: rank %d was given kernels.compression=%s, int8_block_size=%d; every "
            "rank uses rank 0's, %s and %d (the gradient hook's collectives must match)",
            rank, mine.compression, mine.int8_block_size, deal.compression,
            deal.int8_block_size,
        )  # fmt: skip
    off = [r for r, t in enumerate(terms) if not t.collector]
    if not mine.collector and deal.hook:
        log.warning(
            "trainspec: the collector is off on this rank (%d) but not on every rank: its DDP "
            "model still carries trainspec's gradient hook, so that its collectives match "
            "theirs; nothing is collected here",
            rank,
        )
    elif mine.collector and off:
        log.warning("trainspec: the collector is off on rank(s) %s: they store nothing",
                    off)  # fmt: skip
    no_probe = [r for r, t in enumerate(terms) if not t.probe]
    if mine.probe and no_probe:
        log.warning(
            "trainspec: rank(s) %s run no latency probe (collector.enabled or "
            "collector.probe): no rank probes, since a probe waits for every rank",
            no_probe,
        )
    return deal


def agree(mine: Terms, group: Any, rank: int, world_size: int) -> Agreement:
    """Every rank's terms, gathered on `group` (collective: every rank calls it at init)."""
    import torch.distributed as dist

    votes: list[Any] = [None] * world_size
    dist.all_gather_object(votes, mine.as_wire(), group=group)
    return settle(votes, rank)
