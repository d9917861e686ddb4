"""Error-feedback residuals through DDP's bucket rebuild (kernels/residual_layout.py), driven
as the hook drives them: per bucket, take what is owed, then keep the bucket's new residual
under its index. Before, a residual whose layout matched no rebuilt bucket was dropped, and
one under an index reused by other parameters was overwritten."""

from __future__ import annotations

import pytest
import torch

from trainspec.kernels.residual_layout import (
    Layout,
    bucket_shapes,
    layout_of,
    pool_stale,
    split_by_parameter,
    take_residual,
)

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
            for (pid, _n, _), piece in zip(made_for, residual.split([n for _, n, _ in made_for])):
                given.setdefault(pid, []).append(piece)
        kept[key] = (now, torch.full((sum(n for _, n, _ in now),), -1.0))  # the bucket's new one
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


def test_a_complex_parameter_spans_its_real_view() -> None:
    """DDP sums a complex gradient as `torch.view_as_real`: two floats a value. Before, the
    layout counted p.numel(), so no residual of a complex parameter fit its bucket."""
    w, v, s = (
        torch.zeros(4, 3, dtype=torch.cfloat),
        torch.zeros(5, dtype=torch.cfloat),
        torch.zeros((), dtype=torch.cfloat),
    )
    layout = layout_of([w, v, s])
    assert [n for _, n, _ in layout] == [24, 10, 2]
    # A low-rank codec sees a 4 x 6 matrix, and a complex vector as a vector it sends exactly.
    assert bucket_shapes([w, v, s]) == [(4, 3, 2), (10,), (2,)]
    assert bucket_shapes([torch.zeros(4, 3)]) == [(4, 3)]
    pieces = split_by_parameter([(layout, torch.arange(36.0))])
    assert [pieces[id(p)].tolist() for p in (w, v, s)] == [
        list(range(24)),
        list(range(24, 34)),
        [34.0, 35.0],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.cfloat])
def test_pieces_leave_in_logical_order_and_come_back_in_the_buckets(dtype: torch.dtype) -> None:
    """A `channels_last` parameter's gradient sits in its bucket in memory order (DDP follows
    the parameter's strides); its piece goes out as `p.reshape(-1)` would lay it out, and a
    bucket takes it back in its memory order."""
    logical = torch.arange(2 * 3 * 4 * 5 * (2 if dtype.is_complex else 1), dtype=torch.float32)
    values = torch.view_as_complex(logical.view(-1, 2)) if dtype.is_complex else logical
    w = values.view(2, 3, 4, 5).to(memory_format=torch.channels_last)
    b = torch.zeros(3, dtype=dtype)  # one bucket, one dtype
    real = torch.view_as_real(w) if dtype.is_complex else w
    memory = real.permute(0, 2, 3, 1, *range(4, real.dim())).reshape(-1)  # N, H, W, C order
    assert not torch.equal(memory, logical)
    layout = layout_of([b, w])
    residual = torch.cat([torch.full((layout[0][1],), -1.0), memory])
    pieces = split_by_parameter([(layout, residual)])
    assert torch.equal(pieces[id(w)], logical)
    pool = dict(pieces)
    taken = take_residual({}, pool, 0, layout, set())
    assert taken is not None and torch.equal(taken[1], residual) and pool == {}


def test_a_parameter_laid_out_in_logical_order_keeps_its_piece_as_it_is() -> None:
    """Contiguous parameters (the format of every checkpoint written before) and parameters
    that are not dense, which DDP lays out logically: nothing is reordered. A transposed one
    is dense, laid out in memory order."""
    base = torch.zeros(6, 4)
    for p in (torch.zeros(6, 4), base[::2]):
        layout = layout_of([p])
        assert layout[0][2] is None
        piece = torch.arange(float(p.numel()))
        assert torch.equal(split_by_parameter([(layout, piece)])[id(p)], piece)
    transposed = base.t()
    memory = torch.arange(24.0)  # the bucket holds transposed's values in base's order
    piece = split_by_parameter([(layout_of([transposed]), memory)])[id(transposed)]
    assert torch.equal(piece, memory.view(6, 4).t().reshape(-1))


def test_a_codec_plans_a_strided_parameter_as_its_bucket_holds_it() -> None:
    """A transposed weight's gradient lies in its bucket in the base matrix's order: the
    low-rank codec plans it as that matrix (the transpose), not as the logical shape's rows
    cut across memory. `channels_last` keeps N rows, its columns in memory order; a complex
    one keeps its real and imaginary parts innermost."""
    base = torch.zeros(16, 24)
    conv = torch.zeros(8, 3, 5, 5).to(memory_format=torch.channels_last)
    cplx = torch.zeros(4, 6, dtype=torch.cfloat).t()
    assert bucket_shapes([base.t(), conv, cplx, torch.zeros(1, 24)]) == [
        (16, 24),
        (8, 5, 5, 3),
        (4, 6, 2),
        (1, 24),
    ]
