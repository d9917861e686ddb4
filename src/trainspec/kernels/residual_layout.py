"""Error-feedback residuals follow their parameters when DDP reorders a bucket.

A residual is one flat tensor over a bucket's gradients, in the order of the bucket's
parameters. DDP rebuilds its buckets after the first step (in the order gradients became
ready), and a bucket may keep its index and size while its parameters change places: a
residual laid back by index alone lands on other parameters, and the running sum of applied
updates is no longer unbiased. So a residual is kept with the layout it was made for and
re-cut to the bucket's layout now: the same parameters in another order are moved piece by
piece, found under whichever bucket index they were kept. When a rebuild also regroups the
parameters (step 0 runs every parameter in DDP's one initial bucket; the rebuilt buckets
split them), no kept residual is made for the bucket: the residuals kept under layouts of
before the rebuild are cut into one piece per parameter (a pool, the form a checkpoint
restores too), and each bucket takes its parameters' pieces from it, so no residual is lost.
A bucket of parameters no residual was made for starts without one. DDP rebuilds alike on
every rank, so every rank decides alike.

A bucket holds what DDP sums: a complex parameter's gradient as its real view (two floats a
value, `torch.view_as_real`), and a dense parameter's values in its memory order (DDP's
reducer lays each gradient out with its parameter's strides, `gradient_as_bucket_view` or
not: a `channels_last` weight's piece runs over channels first). So a `Slot` counts real
values, and one held out of logical order says how it is strided. Pieces cut out per
parameter (a checkpoint, the pool) are in logical order, the parameter's real view made
contiguous, and go back into a bucket's memory order when a bucket takes them: a residual
saved from a `channels_last` model lands on the same values of a contiguous one, and the
other way round. For a contiguous parameter both orders are one, as before.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch

# The (sizes, strides) of a parameter's real view where its bucket holds it in another order
# than the logical one.
Strided = tuple[tuple[int, ...], tuple[int, ...]]
# One parameter's span of a bucket: (id of the parameter, its number of real values, its
# `Strided` or None when the bucket holds it in logical order). Plain tuples: a layout is
# made per bucket per step, and a NamedTuple's construction alone cost 1 us a parameter.
Slot = tuple[int, int, Strided | None]
Layout = tuple[Slot, ...]  # the bucket's parameters, in order


def layout_of(parameters: Sequence[torch.Tensor]) -> Layout:
    """The layout of a bucket of `parameters`, which share a dtype (as a DDP bucket's do: DDP
    buckets by dtype and device). A complex parameter counts two values for each of its
    own (DDP sums complex gradients as `torch.view_as_real`)."""
    per_value = 2 if parameters and parameters[0].is_complex() else 1
    return tuple(
        (id(p), per_value * p.numel(), None if p.is_contiguous() else _strided(p))
        for p in parameters
    )


def bucket_shapes(parameters: Sequence[torch.Tensor]) -> list[torch.Size]:
    """The shapes a codec plans a bucket of `parameters` (one dtype, as in `layout_of`) by, in
    the order the bucket holds each parameter's values: `p.shape` for a contiguous parameter;
    for one DDP lays out in another memory order (`_strided`), its dimensions ordered as
    memory holds them (outermost first, size-1 dimensions left out), so a low-rank codec's
    matrix is the parameter's own or its transpose: a transposed (64, 32) weight is planned as
    the 32 x 64 matrix its gradient really is in the bucket, not as 32 rows cut across its
    columns (whose rank tells nothing); a `channels_last` (N, C, H, W) weight as N x (H W C),
    its rows' values in another column order. A complex parameter of two or more dimensions
    is its real view, `shape + (2,)`, so a low-rank codec sees a matrix of shape[0] rows and
    2 x the rest columns (each row's real and imaginary parts side by side, as the bucket
    holds them); a complex vector or scalar is a real vector of 2 x numel values, sent
    exactly as a real vector is rather than compressed as an (n, 2) matrix."""
    return [_bucket_shape(p) for p in parameters]


def _bucket_shape(p: torch.Tensor) -> torch.Size:
    if p.is_complex() and p.dim() < 2:
        return torch.Size([2 * p.numel()])
    strided = None if p.is_contiguous() else _strided(p)
    if strided is not None:
        sizes, strides = strided
        by_memory = sorted(
            ((stride, size) for size, stride in zip(sizes, strides, strict=True) if size != 1),
            key=lambda dim: -dim[0],
        )
        return torch.Size([size for _, size in by_memory])
    return torch.Size([*p.shape, 2]) if p.is_complex() else p.shape


def _strided(p: torch.Tensor) -> Strided | None:
    """(sizes, strides) of `p`'s real view when DDP lays its gradient out in memory order other
    than the logical one: `p` dense and non-overlapping but not contiguous (`channels_last`, a
    transposed matrix). DDP lays out any other parameter logically (reducer.cpp
    `initialize_bucket_views`)."""
    if p.is_contiguous() or p.numel() == 0:
        return None
    sizes, strides = tuple(p.shape), tuple(p.stride())
    if p.is_complex():
        sizes, strides = (*sizes, 2), (*(2 * s for s in strides), 1)
    dims = sorted((stride, size) for size, stride in zip(sizes, strides, strict=True) if size != 1)
    expected = 1  # dense: by stride, each dimension steps over all the ones inside it
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return sizes, strides


def logical_piece(piece: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A parameter's flat piece of a bucket (memory order) in logical order."""
    _, numel, strided = slot
    if strided is None or piece.numel() != numel:
        return piece
    return piece.contiguous().as_strided(*strided).reshape(-1)


def memory_piece(piece: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A parameter's flat piece in logical order (`logical_piece`) in the bucket's memory order;
    flat as it is when it does not fit the parameter (the bucket then drops it)."""
    _, numel, strided = slot
    flat = piece.reshape(-1)
    if strided is None or flat.numel() != numel:
        return flat
    sizes, strides = strided
    out = torch.empty_strided(sizes, strides, dtype=flat.dtype, device=flat.device)
    out.copy_(flat.view(sizes))
    return out.as_strided((numel,), (1,))


def fit_residual(residual: torch.Tensor, made_for: Layout, now: Layout) -> torch.Tensor | None:
    """`residual` (made for the layout `made_for`) laid out for `now`, or None when the
    bucket no longer holds the same parameters."""
    if made_for == now:
        return residual
    if sorted(made_for) != sorted(now) or residual.numel() != sum(n for _, n, _ in now):
        return None
    cut = residual.split([n for _, n, _ in made_for])
    pieces = dict(zip((pid for pid, _, _ in made_for), cut, strict=True))
    return torch.cat([pieces[pid] for pid, _, _ in now])


def take_for(
    kept: dict[int, tuple[Layout, torch.Tensor]], key: int, now: Layout
) -> tuple[int, tuple[Layout, torch.Tensor]] | None:
    """Remove and return (its key, entry) of the residual made for the parameters of `now`:
    the one under `key` when it is theirs, else one kept under another index."""
    entry = kept.get(key)
    if entry is not None and entry[0] == now:  # every step but a rebuild's: no sorting
        return key, kept.pop(key)
    wanted = sorted(now)
    for other, (layout, _) in list(kept.items()):
        if sorted(layout) == wanted:
            return other, kept.pop(other)
    return None


def split_by_parameter(residuals: Sequence[tuple[Layout, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Each residual cut into one flat piece per parameter, keyed by id(parameter), in logical
    order: the form that outlives a bucket layout (a restarted job's DDP starts from its
    initial buckets, and the model may be in another memory format)."""
    pieces: dict[int, torch.Tensor] = {}
    for layout, residual in residuals:
        if residual.numel() != sum(n for _, n, _ in layout):
            continue  # not laid out for these parameters: nothing to cut it by
        cut = residual.split([n for _, n, _ in layout])
        pieces.update((s[0], logical_piece(c, s)) for s, c in zip(layout, cut, strict=True))
    return pieces


def take_pieces(
    pool: dict[int, torch.Tensor], key: int, now: Layout
) -> tuple[int, tuple[Layout, torch.Tensor]] | None:
    """Remove the pieces of the parameters of `now` from `pool` (logical order) and return them
    as one residual for bucket `key` in its memory order (zeros for a parameter without a
    piece: nothing owed), or None when `pool` holds none of them."""
    found = [pool.pop(pid, None) for pid, _, _ in now]
    first = next((p for p in found if p is not None), None)
    if first is None:
        return None
    parts = [
        memory_piece(p, s)
        if p is not None
        else torch.zeros(s[1], dtype=first.dtype, device=first.device)
        for p, s in zip(found, now, strict=True)
    ]
    return key, (now, torch.cat(parts))


def pool_stale(
    kept: dict[int, tuple[Layout, torch.Tensor]],
    pool: dict[int, torch.Tensor],
    current: Container[int],
) -> None:
    """Move every residual of `kept` not under a key in `current` (the buckets this step has
    launched, whose residuals are this step's own) into `pool`, one piece per parameter."""
    stale = [key for key in kept if key not in current]
    if stale:
        pool.update(split_by_parameter([kept.pop(key) for key in stale]))


def take_residual(
    kept: dict[int, tuple[Layout, torch.Tensor]],
    pool: dict[int, torch.Tensor],
    key: int,
    now: Layout,
    current: Container[int],
) -> tuple[Layout, torch.Tensor] | None:
    """Remove and return (the layout it was made for, the residual) owed to bucket `key` of
    layout `now`, or None when nothing is owed to its parameters. `current`: the buckets this
    step has launched, whose kept residuals are this step's own and stay. The bucket's own
    index with its own layout costs a dictionary look-up and a comparison (every step but a
    rebuild's); else a residual made for the same parameters under any index; else (a rebuild
    that regrouped the parameters, or a resume) the stale residuals go to `pool` and the
    bucket takes its parameters' pieces from it. A stale residual under `key` goes to `pool`
    too: this bucket's new residual is kept under `key` and would replace it."""
    if not kept and not pool:  # a level without error feedback (`none`, `bf16`): no sorting
        return None
    found = take_for(kept, key, now)
    if found is not None and found[0] == key:
        return found[1]
    if key in kept:  # made for other parameters, which another bucket now holds
        pool.update(split_by_parameter([kept.pop(key)]))
    if found is not None:
        return found[1]
    pool_stale(kept, pool, current)
    taken = take_pieces(pool, key, now) if pool else None
    return None if taken is None else taken[1]
