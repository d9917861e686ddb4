"""The zero-code layer's sample count: which DataLoader batches a step trains on, and their size.

A batch counts once a training forward (with gradients) takes it. Before that it waits here,
one per loader iterator: a loader's next batch replaces its last one (a loop that reads one
batch ahead trains on one batch a forward), while batches of different loaders read for one
forward add up (`for a, b in zip(loader_a, loader_b)`: the step trains on both; the last one
read was the only one counted). A batch that an evaluation's forward (under `no_grad`) took
is dropped at the next batch read, and so is every batch waiting when a loader ends (zipped
loaders of different lengths: the longer one's batch read in the round the shorter one ended
is never trained on; it was counted in the next epoch's first step), unless a training
forward takes it first. An evaluation loop that reads its batches with gradients on is not
counted in the next training step. Not handled: a loop that reads one batch ahead (a
prefetcher) counts each forward the batch read before it, so an epoch's sizes [4, 4, 2]
count [4, 2, 0].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# How deep a batch's structure is searched for its first tensor (objects can refer back).
MAX_DEPTH = 4


@dataclasses.dataclass
class _Waiting:
    samples: int  # 0: the batch did not say (the forward's input counts instead)
    wait_s: float
    stale: bool = False  # an evaluation's forward ran, or a loader ended, since it was read


class PendingBatches:
    """Batches read and not yet taken by a training forward, by loader iterator."""

    def __init__(self) -> None:
        self._waiting: dict[int, _Waiting] = {}

    def read(self, source: object, batch: Any, wait_s: float) -> None:
        """`source` (a loader iterator) gave `batch` after `wait_s` seconds."""
        self._waiting = {k: w for k, w in self._waiting.items() if not w.stale}
        self._waiting[id(source)] = _Waiting(batch_size(batch), wait_s)

    def ended(self, source: object) -> None:
        """`source` is exhausted: what waits now is trained on by a forward before the next
        batch is read (a read-ahead loop's last batch), or never (the round of a `zip`)."""
        self._mark_stale()

    def evaluated(self) -> None:
        """A forward under `no_grad` ran: what waits now was the evaluation's, unless a
        training forward takes it before the next batch is read."""
        self._mark_stale()

    def _mark_stale(self) -> None:
        for w in self._waiting.values():
            w.stale = True

    def take(self, inputs: Any = None) -> tuple[int, float]:
        """A training forward takes every waiting batch: their samples and data wait. A
        batch whose size is unknown (a collate function's own type) counts the forward's
        input's first dimension, once however many such batches wait."""
        samples = sum(w.samples for w in self._waiting.values())
        wait_s = sum(w.wait_s for w in self._waiting.values())
        if any(not w.samples for w in self._waiting.values()) and inputs is not None:
            samples += batch_size(inputs)
        self._waiting.clear()
        return samples, wait_s

    def clear(self) -> None:
        self._waiting.clear()


def leading_dim(x: Any) -> int | None:
    """The first dimension of an array-like `x` (0 when it has none or will not say: a
    nested tensor's `shape` raises); None when `x` is no array."""
    try:
        if not hasattr(x, "shape"):
            return None
        dim = x.dim() if callable(getattr(x, "dim", None)) else len(x.shape)
        return int(x.size(0) if callable(getattr(x, "size", None)) else x.shape[0]) if dim else 0
    except Exception:  # noqa: BLE001 - a tensor that cannot tell its size counts no samples
        return 0


def batch_size(batch: Any, depth: int = 0) -> int:
    """Samples in a batch: the first dimension of its first tensor (in a tuple, list or
    mapping, as a DataLoader collates them, or in the fields or attributes of an object a
    collate function made, such as a dataclass), or the length of a list of plain items
    (texts). 0 when it cannot tell."""
    leading = leading_dim(batch)
    if leading is not None:
        return leading
    if depth >= MAX_DEPTH or batch is None or isinstance(batch, (str, bytes, int, float)):
        return 0
    if isinstance(batch, Mapping):
        return _first(batch.values(), depth)
    if isinstance(batch, (list, tuple)):
        if not batch:
            return 0
        first = _first(batch, depth)
        if first:
            return first
        plain = not any(
            isinstance(x, (list, tuple, Mapping)) or leading_dim(x) is not None for x in batch
        )
        return len(batch) if isinstance(batch, list) and plain else 0
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _first((getattr(batch, f.name, None) for f in dataclasses.fields(batch)), depth)
    attributes = getattr(batch, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(batch, type):
        return _first(attributes.values(), depth)
    return 0


def _first(items: Any, depth: int) -> int:
    return next((n for n in (batch_size(x, depth + 1) for x in items) if n), 0)
