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
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch

Layout = tuple[tuple[int, int], ...]  # (id of the parameter, its number of elements), in order


def layout_of(parameters: Sequence[torch.Tensor]) -> Layout:
    return tuple((id(p), p.numel()) for p in parameters)


def fit_residual(residual: torch.Tensor, made_for: Layout, now: Layout) -> torch.Tensor | None:
    """`residual` (made for the layout `made_for`) laid out for `now`, or None when the
    bucket no longer holds the same parameters."""
    if made_for == now:
        return residual
    if sorted(made_for) != sorted(now) or residual.numel() != sum(n for _, n in now):
        return None
    pieces = dict(zip((pid for pid, _ in made_for), residual.split([n for _, n in made_for])))
    return torch.cat([pieces[pid] for pid, _ in now])


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
    """Each residual cut into one flat piece per parameter, keyed by id(parameter): the form
    that outlives a bucket layout (a restarted job's DDP starts from its initial buckets)."""
    pieces: dict[int, torch.Tensor] = {}
    for layout, residual in residuals:
        if residual.numel() != sum(n for _, n in layout):
            continue  # not laid out for these parameters: nothing to cut it by
        pieces.update(zip((pid for pid, _ in layout), residual.split([n for _, n in layout])))
    return pieces


def take_pieces(
    pool: dict[int, torch.Tensor], key: int, now: Layout
) -> tuple[int, tuple[Layout, torch.Tensor]] | None:
    """Remove the pieces of the parameters of `now` from `pool` and return them as one residual
    for bucket `key` (zeros for a parameter without a piece: nothing owed), or None when
    `pool` holds none of them."""
    found = [pool.pop(pid, None) for pid, _ in now]
    first = next((p for p in found if p is not None), None)
    if first is None:
        return None
    parts = [
        p if p is not None else torch.zeros(n, dtype=first.dtype, device=first.device)
        for p, (_, n) in zip(found, now, strict=True)
    ]
    return key, (now, torch.cat([p.reshape(-1) for p in parts]))


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
