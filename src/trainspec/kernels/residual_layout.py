"""Error-feedback residuals follow their parameters when DDP reorders a bucket.

A residual is one flat tensor over a bucket's gradients, in the order of the bucket's
parameters. DDP rebuilds its buckets after the first step (in the order gradients became
ready), and a bucket may keep its index and size while its parameters change places: a
residual laid back by index alone lands on other parameters, and the running sum of applied
updates is no longer unbiased. So a residual is kept with the layout it was made for and
re-cut to the bucket's layout now: the same parameters in another order are moved piece by
piece, found under whichever bucket index they were kept; a bucket of parameters no residual
was made for starts without one. DDP rebuilds alike on every rank, so every rank decides
alike.
"""

from __future__ import annotations

from collections.abc import Sequence

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
