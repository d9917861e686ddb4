"""Error-feedback residuals through DDP's bucket rebuild (kernels/residual_layout.py), driven
as the hook drives them: per bucket, take what is owed, then keep the bucket's new residual
under its index. Before, a residual whose layout matched no rebuilt bucket was dropped, and
one under an index reused by other parameters was overwritten."""

from __future__ import annotations

import torch

from trainspec.kernels.residual_layout import Layout, layout_of, pool_stale, take_residual

Kept = dict[int, tuple[Layout, torch.Tensor]]


def _params(*sizes: int) -> list[torch.Tensor]:
    return [torch.zeros(n) for n in sizes]


def _kept_from(buckets: list[list[torch.Tensor]], values: dict[int, torch.Tensor]) -> Kept:
    """Residuals of `buckets` (by index), each parameter's piece from `values`."""
    return {
        key: (layout_of(bucket), torch.cat([values[id(p)] for p in bucket]))
        for key, bucket in enumerate(buckets)
    }


def _step(
    kept: Kept, pool: dict[int, torch.Tensor], buckets: dict[int, list[torch.Tensor]]
) -> dict[int, list[torch.Tensor]]:
    """One step over `buckets` (index -> parameters, in DDP's order): the pieces each parameter
    was given, and how many times."""
    given: dict[int, list[torch.Tensor]] = {}
    launched: set[int] = set()
    for key, bucket in buckets.items():
        now = layout_of(bucket)
        owed = take_residual(kept, pool, key, now, launched)
        if owed is not None:
            made_for, residual = owed
            for (pid, _n), piece in zip(made_for, residual.split([n for _, n in made_for])):
                given.setdefault(pid, []).append(piece)
        kept[key] = (now, torch.full((sum(n for _, n in now),), -1.0))  # the bucket's new one
        launched.add(key)
    return given


def test_a_rebuild_that_regroups_and_reorders_gives_every_residual_back_once() -> None:
    a, b, c, d, e = _params(3, 5, 2, 4, 1)
    values = {id(p): torch.arange(p.numel(), dtype=torch.float32) + 10 * i
              for i, p in enumerate((a, b, c, d, e))}  # fmt: skip
    kept = _kept_from([[a, b, c], [d, e]], values)
    pool: dict[int, torch.Tensor] = {}
    # Index 0 is reused by other parameters, d and b change buckets, a is alone.
    given = _step(kept, pool, {0: [d, b], 1: [e, c], 2: [a]})
    assert {pid: len(pieces) for pid, pieces in given.items()} == {pid: 1 for pid in values}
    for pid, expected in values.items():
        assert torch.equal(given[pid][0], expected)
    assert pool == {}
    assert {key: layout for key, (layout, _) in kept.items()} == {
        0: layout_of([d, b]),
        1: layout_of([e, c]),
        2: layout_of([a]),
    }


def test_a_bucket_found_under_another_index_leaves_the_stale_one_under_its_own() -> None:
    a, b, c = _params(3, 5, 2)
    values = {id(p): torch.full((p.numel(),), float(i + 1)) for i, p in enumerate((a, b, c))}
    kept = _kept_from([[a, b], [c]], values)
    pool: dict[int, torch.Tensor] = {}
    # Bucket 0 is c now (found under index 1); a and b, kept under 0, come back at index 1.
    given = _step(kept, pool, {0: [c], 1: [b, a]})
    assert {pid: [t.tolist() for t in pieces] for pid, pieces in given.items()} == {
        id(c): [[3.0] * 2],
        id(a): [[1.0] * 3],
        id(b): [[2.0] * 5],
    }
    assert pool == {}


def test_a_resume_pool_feeds_the_initial_bucket_and_its_residual_the_rebuilt_ones() -> None:
    a, b, c = _params(3, 5, 2)
    pool = {id(a): torch.ones(3), id(c): torch.full((2,), 2.0)}  # b without a piece: zeros
    kept: Kept = {}
    given = _step(kept, pool, {0: [c, b, a]})  # DDP's one initial bucket
    assert [given[id(p)][0].tolist() for p in (a, b, c)] == [[1.0] * 3, [0.0] * 5, [2.0] * 2]
    assert pool == {}
    given = _step(kept, pool, {0: [c], 1: [b, a]})  # rebuilt: the initial bucket's residual
    assert all(len(given[id(p)]) == 1 and (given[id(p)][0] == -1.0).all() for p in (a, b, c))
    assert pool == {}


def test_a_bucket_with_its_own_layout_takes_its_own_tensor_and_moves_nothing() -> None:
    a, b, c = _params(3, 5, 2)
    kept = _kept_from([[a, b], [c]], {id(p): torch.ones(p.numel()) for p in (a, b, c)})
    own, other = kept[0], kept[1]
    pool: dict[int, torch.Tensor] = {}
    assert take_residual(kept, pool, 0, layout_of([a, b]), set()) is own
    assert kept == {1: other} and pool == {}


def test_pool_stale_keeps_the_residuals_of_buckets_this_step_launched() -> None:
    a, b = _params(3, 5)
    kept = _kept_from([[a], [b]], {id(a): torch.ones(3), id(b): torch.zeros(5)})
    pool: dict[int, torch.Tensor] = {}
    pool_stale(kept, pool, {0})
    assert list(kept) == [0] and list(pool) == [id(b)]
