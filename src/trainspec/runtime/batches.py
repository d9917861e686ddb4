"""The zero-code layer's sample count: which DataLoader batches a step trains on, and their size.

A batch counts once a training forward (with gradients) takes it; without a DDP model (no
forward seen), a backward, or the optimizer's step where no backward is seen. Before that it
waits here, in the order read, per loader iterator. A training forward takes, of each
iterator, the batch its input is: one that holds a tensor of its input (the batch's own, or
a view of it such as `x[:, :-1]`), else the oldest of the input's first dimension (the batch
copied to a device), else the last one read. Batches of that iterator read before the one
taken are dropped (the loop skipped them); those read after it wait for the next forward: a
loop that reads one batch ahead (a prefetcher, `nxt = next(it, None); model(batch); batch =
nxt`) counted each forward the batch read before it, an epoch of [4, 4, 2] as [4, 2, 0].
Other than a batch its input holds, a forward takes one of an iterator only if the loop
asked it for a batch (read one, or found its end) since a forward last took one, so a GAN's
generator, run on noise of the batch's size after the discriminator took the batch, takes
no batch read ahead. Batches of different loaders read for one forward add up (`for a, b in
zip(loader_a, loader_b)`: the step trains on both).

A backward without DDP sees no input: it takes, of each iterator the loop asked for a batch
since its last take, all but the newest batch waiting (one read ahead), or all where one
waits or the iterator ended since. A loop that reads one batch ahead counts each step the
batch it trains on; a loop that reads k batches for one backward (`sum(loss(next(it)) for _
in range(k)).backward()`) counts k a step, but k - 1 in an iterator's first step (it cannot
be told from a read-ahead loop there), and the batch it read last is not counted where the
loader's end is found after its last backward (an epoch of n batches counts n - 1).

A batch that an evaluation's forward (under `no_grad`) took is dropped at the next batch
read, and so is every batch waiting when a loader ends (zipped loaders of different lengths:
the longer one's batch read in the round the shorter one ended is never trained on), unless a
training forward takes it first: one whose input it is, or, where the step read a batch for
training since its last forward under no_grad (`fed`: an evaluation ran between the read and
the forward), any training forward. A step that reads no batch and whose forwards' inputs are
none that waits trains on tensors of its own (auto_instrumentation.py counts its inputs). An evaluation loop
that reads its batches with gradients on is not counted in the next training step. The data
wait of every batch read since the last training forward counts in the next one, whichever
batch it trains on (the step that waited for it).

Not handled: a read-ahead loop whose forward's input is a copy of the batch (moved to a
device) of another first dimension (sequence first, reshaped) counts the last batch read, as
before; a loop that skips batches whose forwards' inputs are copies may count, of
batches of one size, a later one than it trained on (the same count).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Mapping
from typing import Any

# How deep a batch's structure is searched for its first tensor (objects can refer back).
MAX_DEPTH = 4
# Tensors of a batch (or a forward's input) kept to tell which batch a forward trains on.
MAX_TENSORS = 16
# Items of one list, tuple or mapping searched for tensors (a batch of texts is a long list).
MAX_ITEMS = 64
# Batches that wait per loader iterator: a prefetcher reads a few ahead, a loop that skips
# batches of one size leaves one more waiting each time, a loop without DDP that reads k
# batches for one backward leaves k + 1 (the oldest go first; weak references only).
MAX_WAITING = 64


@dataclasses.dataclass
class _Waiting:
    samples: int  # 0: the batch did not say (the forward's input counts instead)
    wait_s: float  # counted once, by the first training forward after the read
    tensors: list[tuple[Any, int]]  # (a weak reference, its data pointer) per tensor
    stale: bool = False  # an evaluation's forward ran, or a loader ended, since it was read

    def holds(self, ids: set[int], pointers: set[int]) -> bool:
        """Whether a tensor of the forward's input is one of this batch's (or a view of
        it): only tensors still alive (a freed one's memory may be a later batch's)."""
        for ref, pointer in self.tensors:
            tensor = ref()
            if tensor is not None and (id(tensor) in ids or (pointer and pointer in pointers)):
                return True
        return False


class _Source:
    """One loader iterator's batches, oldest first, and whether the loop asked it for one
    (a batch read, or its end) since a training forward last took one of them."""

    def __init__(self) -> None:
        self.batches: list[_Waiting] = []
        self.asked = True
        self.ended = False  # the loop found its end since a take of its batches


class PendingBatches:
    """Batches read and not yet taken by a training forward, by loader iterator."""

    def __init__(self) -> None:
        self._sources: dict[int, _Source] = {}

    def read(self, source: object, batch: Any, wait_s: float) -> None:
        """`source` (a loader iterator) gave `batch` after `wait_s` seconds."""
        self._drop_stale()
        waiting = self._sources.setdefault(id(source), _Source())
        waiting.batches.append(_Waiting(batch_size(batch), wait_s, _references(batch)))
        del waiting.batches[:-MAX_WAITING]
        waiting.asked = True

    def ended(self, source: object) -> None:
        """`source` is exhausted: what waits now is trained on by a forward before the next
        batch is read (a read-ahead loop's last batch), or never (the round of a `zip`)."""
        self._mark_stale()
        waiting = self._sources.get(id(source))
        if waiting is not None:  # the loop asked it for a batch: `next(it, None)`
            waiting.asked = True
            waiting.ended = True

    def evaluated(self) -> None:
        """A forward under `no_grad` ran: what waits now was the evaluation's, unless a
        training forward takes it before the next batch is read."""
        self._mark_stale()

    def waiting(self) -> bool:
        return bool(self._sources)

    def _mark_stale(self) -> None:
        for waiting in self._sources.values():
            for w in waiting.batches:
                w.stale = True

    def _drop_stale(self) -> None:
        for key, waiting in list(self._sources.items()):
            waiting.batches = [w for w in waiting.batches if not w.stale]
            if not waiting.batches:
                del self._sources[key]

    def take(self, inputs: Any = None, *, fed: bool = True) -> tuple[int, float]:
        """A training forward on `inputs` takes, of each loader iterator, the batch it trains
        on: their samples, and the data wait of every batch read since the last training
        forward. A batch whose size is unknown (a collate function's own type) counts the
        forward's input's first dimension, once however many such batches it takes. `fed`:
        the step read a batch for its training, so a stale batch that the input is not
        still counts (an evaluation ran between the read and the forward); else it is no
        batch of this step's."""
        ids: set[int] = set()
        pointers: set[int] = set()
        size = 0
        if inputs is not None:
            for tensor in _tensors(inputs):
                ids.add(id(tensor))
                pointers.add(_pointer(tensor))
            pointers.discard(0)
            size = batch_size(inputs)
        samples, wait_s, unknown = 0, 0.0, False
        for key, waiting in list(self._sources.items()):
            queue = waiting.batches
            if inputs is None:  # a backward without DDP: the oldest batches it trains on
                taken = _pick_without_input(waiting, fed=fed)
            else:
                picked = _pick(queue, ids, pointers, size, fed=fed, asked=waiting.asked)
                taken = [] if picked is None else [picked]
            for i, w in enumerate(queue):
                if not w.stale or i in taken:
                    wait_s += w.wait_s
                w.wait_s = 0.0
            if not taken:
                waiting.batches = [w for w in queue if not w.stale]
            else:
                for i in taken:
                    samples += queue[i].samples
                    unknown = unknown or not queue[i].samples
                waiting.batches = queue[taken[-1] + 1 :]  # read ahead (stale: dropped at a read)
                waiting.asked = waiting.ended = False
            if not waiting.batches:
                del self._sources[key]
        if unknown and inputs is not None:
            samples += size
        return samples, wait_s

    def clear(self) -> None:
        self._sources.clear()


def _pick_without_input(waiting: _Source, *, fed: bool) -> list[int]:
    """The indices (oldest first) of the batches of one iterator that a backward without DDP
    trains on. With no forward's input to tell, a loop that reads one batch ahead (a
    prefetcher: 2 wait at its first backward, it trains on the older) is told from one that
    reads k batches for one backward by what a take leaves: all but the newest batch waiting
    (one read ahead), so the read-ahead loop keeps one ahead (1 carried and 1 read since: it
    takes 1) and the k-batch loop its last one (1 carried and k read since: it takes k,
    after a first step that counts k - 1). All where one waits or the iterator ended since
    its last take (none is ahead); none where the loop asked it for no batch since (a
    second backward in the step)."""
    if not waiting.asked:
        return []
    queue = [i for i, w in enumerate(waiting.batches) if fed or not w.stale]
    return queue if waiting.ended or len(queue) < 2 else queue[:-1]


def _pick(
    queue: list[_Waiting],
    ids: set[int],
    pointers: set[int],
    size: int,
    *,
    fed: bool,
    asked: bool,
) -> int | None:
    """The index of the batch in `queue` (one iterator's, oldest first) that a training
    forward on an input of these tensors and first dimension trains on; None: none. A batch
    the input holds is certain; otherwise the forward takes one only if the loop asked the
    iterator for a batch since a forward last took one (a GAN's generator, run on noise of
    the batch's size after the discriminator took the batch, takes no batch read ahead)."""
    if ids:
        for i in range(len(queue) - 1, -1, -1):  # the newest: a freed batch's view is gone
            if queue[i].holds(ids, pointers):
                return i
    if not asked:
        return None
    if size:
        for i, w in enumerate(queue):
            if w.samples == size:
                return i
    return next((i for i in range(len(queue) - 1, -1, -1) if fed or not queue[i].stale), None)


def _references(batch: Any) -> list[tuple[Any, int]]:
    refs = []
    for tensor in _tensors(batch):
        try:
            refs.append((weakref.ref(tensor), _pointer(tensor)))
        except TypeError:  # no weak reference to it: not matched by identity
            continue
    return refs


def _pointer(tensor: Any) -> int:
    """Where a tensor's data starts (a view from its start shares it); 0: it will not say."""
    try:
        return int(tensor.data_ptr())
    except Exception:  # noqa: BLE001 - a sparse or nested tensor has no one pointer
        return 0


def _tensors(batch: Any) -> list[Any]:
    """The array-likes in a batch's structure (as `batch_size` walks it), at most
    MAX_TENSORS."""
    found: list[Any] = []
    _collect(batch, 0, found)
    return found


def _collect(batch: Any, depth: int, found: list[Any]) -> None:
    if len(found) >= MAX_TENSORS:
        return
    if hasattr(batch, "data_ptr") and hasattr(batch, "shape"):
        found.append(batch)
        return
    if depth >= MAX_DEPTH or batch is None or isinstance(batch, (str, bytes, int, float)):
        return
    items: Any = ()
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name, None) for f in dataclasses.fields(batch))
    elif isinstance(getattr(batch, "__dict__", None), dict) and not isinstance(batch, type):
        items = batch.__dict__.values()
    for item in itertools.islice(items, MAX_ITEMS):
        _collect(item, depth + 1, found)
        if len(found) >= MAX_TENSORS:
            return


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
