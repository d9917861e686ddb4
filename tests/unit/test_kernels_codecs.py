"""Round-trip error bounds and error-feedback unbiasedness, through the hook's code path
(`Codec.reduce` on a one-rank `LocalWire`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from trainspec.kernels import LocalWire, make_codec
from trainspec.kernels.codecs import CodecResult, Int8Codec, LowRankCodec
from trainspec.kernels.codecs.int8 import (
    block_count,
    dequantize_accumulate,
    quantize_with_feedback,
)
from trainspec.kernels.codecs.topk import kept_entries


def _reduce(codec, grad, residual=None, weight=1.0, key=0, shapes=None) -> CodecResult:
    return codec.reduce(grad, weight, residual, key, LocalWire(), shapes).wait()


def test_none_is_exact_and_keeps_no_residual() -> None:
    g = torch.randn(1000)
    out = _reduce(make_codec("none"), g.clone(), weight=0.25)  # scaled in place
    assert torch.equal(out.summed, g * 0.25)
    assert out.residual is None


def test_none_keeps_a_float64_model_in_float64() -> None:
    """Plain DDP sums float64 gradients in float64; `none` rounded them to float32."""
    g = torch.randn(1000, dtype=torch.float64) * (1 + 1e-12)
    out = _reduce(make_codec("none"), g.clone(), weight=0.5)
    assert out.summed.dtype == torch.float64 and torch.equal(out.summed, g * 0.5)


def test_a_residual_follows_its_parameters_when_ddp_reorders_a_bucket() -> None:
    from trainspec.kernels.residual_layout import fit_residual

    a, b = torch.zeros(3), torch.zeros(5)
    residual = torch.cat([torch.full((3,), 1.0), torch.full((5,), 2.0)])  # made for [a, b]
    made_for = ((id(a), 3, None), (id(b), 5, None))
    assert fit_residual(residual, made_for, made_for) is residual
    moved = fit_residual(residual, made_for, ((id(b), 5, None), (id(a), 3, None)))
    assert moved is not None and moved.tolist() == [2.0] * 5 + [1.0] * 3
    c = torch.zeros(3)
    assert fit_residual(residual, made_for, ((id(b), 5, None), (id(c), 3, None))) is None


def test_a_residual_is_found_when_its_parameters_move_to_another_bucket_index() -> None:
    from trainspec.kernels.residual_layout import take_for

    a, b, c = torch.zeros(3), torch.zeros(5), torch.zeros(2)
    kept = {
        0: (((id(c), 2, None),), torch.ones(2)),
        1: (((id(a), 3, None), (id(b), 5, None)), torch.zeros(8)),
    }
    found = take_for(kept, 0, ((id(b), 5, None), (id(a), 3, None)))  # a and b are bucket 0 now
    assert found is not None and found[0] == 1 and set(kept) == {0}
    assert take_for(kept, 1, ((id(a), 3, None),)) is None  # parameters no residual was made for
    assert take_for(kept, 1, ((id(c), 2, None),))[0] == 0 and kept == {}


def test_none_flushes_a_residual_left_by_a_lossy_level() -> None:
    g, r = torch.randn(100), torch.randn(100)
    out = _reduce(make_codec("none"), g.clone(), residual=r)
    assert torch.allclose(out.summed, g + r)


def test_none_carries_extra_values_in_the_buckets_own_all_reduce() -> None:
    codec, wire = make_codec("none"), LocalWire()
    g, r = torch.randn(100), torch.randn(100)
    extra = torch.tensor([2.5, 0.125, 1.0])
    assert codec.can_carry(g) and not codec.can_carry(g.to(torch.bfloat16))
    bucket = g.clone()
    out = codec.reduce_carrying(bucket, 0.5, r, 7, wire, extra).wait()
    assert torch.allclose(out.summed, g * 0.5 + r) and out.residual is None
    assert torch.equal(out.extra, extra)
    assert torch.equal(bucket, g)  # scaled into the carrier, not in place
    # one collective for both: the bucket and the three values, in float32
    assert [(rec.op, rec.dtype, rec.payload_bytes) for rec in wire.records] == [
        ("all_reduce", "torch.float32", 4 * 103)
    ]
    # the carrier is reused step after step, not allocated anew
    again = codec.reduce_carrying(torch.randn(100), 1.0, None, 7, wire, extra).wait()
    assert again.summed.data_ptr() == out.summed.data_ptr()


def test_none_keeps_no_carrier_of_a_bucket_layout_ddp_rebuilt_away() -> None:
    # DDP's first step hands the whole model over as one bucket (key 0, the last), then
    # rebuilds its buckets: the last one gets another key and size. The whole-model carrier
    # must not stay allocated beside the new one for the rest of the run.
    codec, wire, extra = make_codec("none"), LocalWire(), torch.zeros(3)
    first = codec.reduce_carrying(torch.randn(1000), 1.0, None, 0, wire, extra).wait()
    whole_model = weakref.ref(first.summed._base)
    del first
    later = codec.reduce_carrying(torch.randn(100), 1.0, None, 2, wire, extra).wait()
    gc.collect()
    assert whole_model() is None
    assert torch.equal(later.extra, extra)


def test_none_does_not_carry_a_bucket_too_large_to_copy() -> None:
    from trainspec.kernels.codecs.none import CARRY_MAX_ELEMENTS

    codec = make_codec("none")
    assert codec.can_carry(torch.empty(CARRY_MAX_ELEMENTS))
    assert not codec.can_carry(torch.empty(CARRY_MAX_ELEMENTS + 1))


def test_only_none_carries() -> None:
    from trainspec.kernels.codecs.base import CarryingCodec

    assert isinstance(make_codec("none"), CarryingCodec)
    for level in ("bf16", "int8", "lowrank:2", "lowrank-bf16:4"):
        assert not isinstance(make_codec(level), CarryingCodec)


def test_bf16_relative_error_bound() -> None:
    g = torch.randn(10_000) * torch.logspace(-6, 3, 10_000)
    out = _reduce(make_codec("bf16"), g)
    rel = ((out.summed - g).abs() / g.abs()).max()
    assert rel <= 2.0**-8  # bf16 keeps 8 significant bits: round-to-nearest error <= 2^-9
    assert out.summed.dtype == torch.float32


@pytest.mark.parametrize("block", [256, 64, 100])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4097])
def test_int8_error_is_at_most_half_a_step_per_block(block: int, n: int) -> None:
    g = torch.randn(n) * 3
    g[n // 2] = 40.0  # an outlier only spoils its own block
    out = _reduce(Int8Codec(block, backend="torch"), g)
    nb = block_count(n, block)
    padded = torch.nn.functional.pad(g, (0, nb * block - n)).view(nb, block)
    step = (padded.abs().amax(1) / 127).repeat_interleave(block)[:n]
    err = (out.summed - g).abs()
    assert (err <= step / 2 + 1e-6).all()
    # the residual is exactly what was not sent
    assert torch.allclose(out.residual, g - out.summed, atol=1e-6)


def test_int8_zero_block_and_payload_layout() -> None:
    g = torch.zeros(300)
    g[260:] = 1.0
    codes, scales, residual = quantize_with_feedback(g, 1.0, None, 256)
    assert codes.dtype == torch.int8 and codes.numel() == 300
    assert scales.tolist() == pytest.approx([1.0, 1.0 / 127])  # all-zero block: scale 1
    assert codes[:256].abs().sum() == 0 and (codes[260:] == 127).all()
    out = torch.zeros(300)
    dequantize_accumulate(out, codes, scales, 256)
    assert torch.allclose(out, g) and residual.abs().max() < 1e-6


def _run_feedback(
    codec, steps: int, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(shape, generator=gen)
    residual = None
    true_sum = torch.zeros(shape).reshape(-1)
    applied_sum = torch.zeros_like(true_sum)
    for _ in range(steps):
        g = (mean + 0.5 * torch.randn(shape, generator=gen)).reshape(-1)
        out = codec.reduce(g, 1.0, residual, 0, LocalWire(), [torch.Size(shape)]).wait()
        residual = out.residual
        true_sum += g
        applied_sum += out.summed
    assert residual is not None
    return true_sum, applied_sum, residual


@pytest.mark.parametrize(
    ("level", "bound"),
    [
        ("int8", 2e-4),
        ("int8:64", 2e-4),
        ("lowrank:2", 0.05),
        ("lowrank:8", 0.02),
        ("lowrank:2:5", 0.05),  # int8 warm-up, then PowerSGD on the int8 residual
        # bf16 factors: the residual is taken against the rounded factors, so the same bounds
        ("lowrank-bf16:2", 0.05),
        ("lowrank-bf16:8", 0.02),
        ("lowrank-bf16:4:5", 0.05),
        # sparsification with memory: an entry left out waits in the residual until it is
        # among the largest (Stich et al. 2018), so the owed part stays bounded
        ("topk:0.1", 0.02),
        ("topk:0.01", 0.2),
    ],
)
def test_error_feedback_keeps_the_running_sum_unbiased(level: str, bound: float) -> None:
    true_sum, applied_sum, residual = _run_feedback(make_codec(level), 300, (48, 40))
    # Exactly: what was applied plus what is still owed equals what was produced.
    assert torch.allclose(applied_sum + residual, true_sum, rtol=1e-4, atol=1e-3)
    # And what is owed stays bounded: it does not grow with the number of steps.
    rel = float((applied_sum - true_sum).norm() / true_sum.norm())
    assert rel < bound, f"{level}: accumulated residual {rel:.4f} of the running sum"


def test_topk_sends_the_largest_entries_exactly_and_keeps_the_rest() -> None:
    gen = torch.Generator().manual_seed(3)
    g, r = torch.randn(1000, generator=gen), 0.1 * torch.randn(1000, generator=gen)
    wire = LocalWire()
    out = make_codec("topk:0.05").reduce(g, 0.5, r, 0, wire).wait()
    x = g * 0.5 + r
    sent = out.summed != 0
    assert int(sent.sum()) == 50  # ceil(0.05 * 1000)
    # exactly the 50 largest magnitudes, sent exactly; everything else owed, exactly
    assert float(x[sent].abs().min()) >= float(x[~sent].abs().max())
    assert torch.equal(out.summed[sent], x[sent]) and torch.equal(out.residual[~sent], x[~sent])
    assert not out.residual[sent].any()
    (record,) = wire.records
    assert (record.op, record.payload_bytes) == ("all_gather", 50 * 8)  # float32 + int32
    assert torch.equal(g, torch.randn(1000, generator=torch.Generator().manual_seed(3)))


def test_topk_counts_its_entries_in_the_decimal_it_names() -> None:
    assert kept_entries(100, 0.07) == 7  # the float product is 7.000000000000001
    assert kept_entries(10**7, 0.01) == 10**5 and kept_entries(101, 0.01) == 2
    assert kept_entries(0, 0.5) == 0  # an empty bucket sends nothing, and does not fail
    empty = _reduce(make_codec("topk:0.5"), torch.zeros(0))
    assert empty.summed.numel() == 0 and empty.residual.numel() == 0


def test_topk_keeps_at_least_one_entry_and_all_of_them_at_one() -> None:
    g = torch.tensor([0.5, -3.0, 1.0])
    small = _reduce(make_codec("topk:0.01"), g)
    assert small.summed.tolist() == [0.0, -3.0, 0.0] and small.residual.tolist() == [0.5, 0, 1.0]
    whole = _reduce(make_codec("topk:1"), g)
    assert torch.equal(whole.summed, g) and not whole.residual.any()


def test_lowrank_without_feedback_would_be_biased() -> None:
    """The bound above is earned by the residual: drop it and the sum drifts."""
    codec = make_codec("lowrank:2")
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(48, 40, generator=gen)
    true_sum = torch.zeros(48 * 40)
    applied = torch.zeros(48 * 40)
    for _ in range(300):
        g = (mean + 0.5 * torch.randn(48, 40, generator=gen)).reshape(-1)
        applied += codec.reduce(g, 1.0, None, 0, LocalWire(), [torch.Size((48, 40))]).wait().summed
        true_sum += g
    assert float((applied - true_sum).norm() / true_sum.norm()) > 0.2


def test_lowrank_is_exact_on_a_matrix_of_its_rank() -> None:
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(30, 2, generator=gen) @ torch.randn(2, 20, generator=gen)
    out = _reduce(LowRankCodec(2), m.reshape(-1), shapes=[m.shape])
    assert torch.allclose(out.summed, m.reshape(-1), atol=1e-4)


def test_lowrank_sends_vectors_and_small_matrices_exactly() -> None:
    shapes = [torch.Size((64, 32)), torch.Size((32,)), torch.Size((3, 3))]
    n = sum(s.numel() for s in shapes)
    g = torch.randn(n)
    wire = LocalWire()
    out = LowRankCodec(2).reduce(g, 1.0, None, 0, wire, shapes).wait()
    tail = 64 * 32
    assert torch.equal(out.summed[tail:], g[tail:])
    assert torch.equal(out.residual[tail:], torch.zeros(n - tail))
    # first all-reduce: exact values, P (64 x 2) and the count of ranks; second: Q (32 x 2)
    assert [r.payload_bytes for r in wire.records] == [4 * (32 + 9 + 64 * 2 + 1), 4 * 32 * 2]


def test_lowrank_warm_start_improves_a_fixed_gradient() -> None:
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(40, 30, generator=gen)
    codec = LowRankCodec(4)
    errors = []
    for _ in range(4):
        out = _reduce(codec, m.reshape(-1), shapes=[m.shape])
        errors.append(float((out.summed - m.reshape(-1)).norm()))
    assert errors[-1] < errors[0]  # subspace iteration converges on M's top singular space
    codec.reset()
    again = float((_reduce(codec, m.reshape(-1), shapes=[m.shape]).summed - m.reshape(-1)).norm())
    assert again == pytest.approx(errors[0])


def test_lowrank_rejects_shapes_that_do_not_cover_the_bucket() -> None:
    with pytest.raises(ValueError, match="cover"):
        _reduce(LowRankCodec(2), torch.randn(10), shapes=[torch.Size((3, 3))])


def test_lowrank_exact_spans_flush_their_residual_and_are_counted() -> None:
    """Biases and norms (1-D) go exactly, residual included, and their bytes are on the wire."""
    shapes = [torch.Size((32,)), torch.Size((48, 40)), torch.Size((40,)), torch.Size((40,))]
    n = sum(s.numel() for s in shapes)
    g, r = torch.randn(n), torch.randn(n)
    wire = LocalWire()
    out = LowRankCodec(2).reduce(g, 0.5, r, 0, wire, shapes).wait()
    vec = torch.cat([torch.arange(32), torch.arange(32 + 48 * 40, n)])
    assert torch.equal(out.summed[vec], (g * 0.5 + r)[vec])
    assert out.residual[vec].abs().max() == 0
    assert [(rec.op, rec.payload_bytes) for rec in wire.records] == [
        ("all_reduce", 4 * (32 + 40 + 40 + 48 * 2 + 1)),  # exact values, P, the count
        ("all_reduce", 4 * 40 * 2),  # Q
    ]


def _ops_per_step(codec: LowRankCodec, steps: int, shapes: list[torch.Size]) -> list[list]:
    n = sum(s.numel() for s in shapes)
    ops = []
    for _ in range(steps):
        wire = LocalWire()
        codec.reduce(torch.randn(n), 1.0, None, 0, wire, shapes).wait()
        ops.append([(rec.op, rec.payload_bytes) for rec in wire.records])
    return ops


def test_lowrank_warmup_sends_int8_first_then_powersgd() -> None:
    shapes = [torch.Size((64, 32)), torch.Size((32,))]
    n = 64 * 32 + 32
    codec = LowRankCodec(2, warmup_steps=3)
    int8 = [("all_gather", n + 4 * -(-n // 256))]
    powersgd = [("all_reduce", 4 * (32 + 64 * 2 + 1)), ("all_reduce", 4 * 32 * 2)]
    assert _ops_per_step(codec, 5, shapes) == [int8] * 3 + [powersgd] * 2
    codec.reset()  # a reset (e.g. error feedback reset on a level switch) warms up again
    assert _ops_per_step(codec, 1, shapes) == [int8]


def test_lowrank_exact_warmup_sends_float32_sums_first_then_powersgd() -> None:
    shapes = [torch.Size((64, 32)), torch.Size((32,))]
    n = 64 * 32 + 32
    codec = make_codec("lowrank:2:3:exact")
    exact = [("all_reduce", 4 * n)]
    powersgd = [("all_reduce", 4 * (32 + 64 * 2 + 1)), ("all_reduce", 4 * 32 * 2)]
    assert _ops_per_step(codec, 5, shapes) == [exact] * 3 + [powersgd] * 2


def test_lowrank_exact_warmup_is_exact_and_flushes_the_residual() -> None:
    g, r = torch.randn(48 * 40), torch.randn(48 * 40)
    shapes = [torch.Size((48, 40))]
    out = _reduce(make_codec("lowrank:2:1:exact"), g.clone(), residual=r, shapes=shapes)
    assert torch.allclose(out.summed, g + r) and out.residual is None


def test_lowrank_warmup_sums_within_int8_bounds() -> None:
    g = torch.randn(48 * 40)
    out = _reduce(LowRankCodec(2, warmup_steps=1), g, shapes=[torch.Size((48, 40))])
    assert (out.summed - g).abs().max() <= g.abs().max() / 127  # int8, not rank 2
    assert torch.allclose(out.residual, g - out.summed, atol=1e-6)


def test_lowrank_warmup_starts_powersgd_in_the_leading_subspace() -> None:
    """Q follows the warm-up sums, so the first PowerSGD step is near the best rank-R
    approximation, where a cold start's single subspace-iteration step is far from it."""
    gen = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(60, 40, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(40, 40, generator=gen)).Q
    s = torch.tensor([10.0, 9.0] + [3.0 * 0.9**i for i in range(38)])
    m = ((u * s) @ v.t()).reshape(-1)
    shapes = [torch.Size((60, 40))]
    best = float(s[2:].norm())  # Eckart-Young: the error of the best rank-2 approximation

    def first_powersgd_error(codec: LowRankCodec) -> float:
        for _ in range(codec.warmup_steps):
            _reduce(codec, m, shapes=shapes)
        return float((_reduce(codec, m, shapes=shapes).summed - m).norm())

    assert first_powersgd_error(LowRankCodec(2)) > 1.3 * best
    assert first_powersgd_error(LowRankCodec(2, warmup_steps=3)) < 1.01 * best


def test_lowrank_seed_picks_the_starting_q() -> None:
    """Seed 0 is the start every earlier figure was measured from; another seed is another
    Q (the first step's approximation differs), the same seed the same one."""
    torch.manual_seed(0)
    m = torch.randn(48, 40)
    shapes = [m.shape]

    def first(seed: int) -> torch.Tensor:
        codec = make_codec("lowrank:2", seed=seed)
        assert isinstance(codec, LowRankCodec) and codec.seed == seed
        return _reduce(codec, m.reshape(-1).clone(), shapes=shapes).summed

    unseeded = _reduce(LowRankCodec(2), m.reshape(-1).clone(), shapes=shapes).summed
    assert torch.equal(first(0), unseeded)
    assert torch.equal(first(5), first(5))
    assert not torch.allclose(first(5), first(0))
    assert torch.equal(make_codec("lowrank-bf16:2", seed=5)._initial_q(40, m.device),
                       LowRankCodec(2, seed=5)._initial_q(40, m.device))  # fmt: skip


@pytest.mark.parametrize("seed", [-1, 1 << 31])
def test_lowrank_refuses_a_seed_out_of_range(seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        LowRankCodec(2, seed=seed)


def test_lowrank_rejects_negative_warmup() -> None:
    with pytest.raises(ValueError, match="warm-up"):
        LowRankCodec(2, warmup_steps=-1)


def test_lowrank_bf16_is_exact_on_a_matrix_of_its_rank_up_to_bf16_rounding() -> None:
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(30, 2, generator=gen) @ torch.randn(2, 20, generator=gen)
    out = _reduce(LowRankCodec(2, factor_dtype=torch.bfloat16), m.reshape(-1), shapes=[m.shape])
    rel = float((out.summed - m.reshape(-1)).norm() / m.norm())
    # P's rounding only tilts the subspace (a rank-2 M is still spanned); Q's is 2^-9 per value
    assert 0 < rel < 2.0**-7
    assert torch.equal(out.residual, m.reshape(-1) - out.summed)  # W = 1: owed = not applied


def test_lowrank_bf16_stays_close_to_float32_factors() -> None:
    """The same step with float32 and bf16 factors: apart by bf16 rounding, not by more."""
    gen = torch.Generator().manual_seed(6)
    m = torch.randn(64, 48, generator=gen)
    shapes = [m.shape]
    full = _reduce(LowRankCodec(4), m.reshape(-1), shapes=shapes).summed
    half = _reduce(LowRankCodec(4, factor_dtype=torch.bfloat16), m.reshape(-1), shapes=shapes)
    assert float((half.summed - full).norm() / full.norm()) < 2.0**-6


def test_lowrank_bf16_residual_is_taken_against_the_decoded_factors() -> None:
    """What bf16 rounding lost is owed: residual = contribution - applied, to the last bit of
    float32, where a residual against float32 factors would miss the rounding."""
    gen = torch.Generator().manual_seed(7)
    m = torch.randn(40, 30, generator=gen).reshape(-1)
    shapes = [torch.Size((40, 30))]
    r = torch.randn(40 * 30, generator=gen) * 0.1
    half = _reduce(LowRankCodec(3, factor_dtype=torch.bfloat16), m, residual=r, shapes=shapes)
    full = _reduce(LowRankCodec(3), m, residual=r, shapes=shapes)
    assert torch.allclose(half.residual, m + r - half.summed, atol=1e-6)
    assert float((half.residual - full.residual).abs().max()) > 1e-4  # rounding was owed


def test_lowrank_bf16_sends_half_the_factor_bytes_and_exact_spans_in_float32() -> None:
    shapes = [torch.Size((64, 32)), torch.Size((32,)), torch.Size((3, 3))]
    n = sum(s.numel() for s in shapes)
    wire = LocalWire()
    out = LowRankCodec(4, factor_dtype=torch.bfloat16).reduce(
        torch.randn(n), 1.0, None, 0, wire, shapes
    )
    tail = 64 * 32
    g = out.wait()
    assert g.residual[tail:].abs().max() == 0  # exact spans: sent exactly, nothing owed
    assert [(r.op, r.dtype, r.payload_bytes) for r in wire.records] == [
        ("all_reduce", "torch.float32", 4 * (32 + 9 + 1)),  # exact values, the count
        ("all_reduce", "torch.bfloat16", 2 * 64 * 4),  # P
        ("all_reduce", "torch.bfloat16", 2 * 32 * 4),  # Q
    ]
    # rank 2R in bf16 costs what rank R costs in float32
    full = LocalWire()
    LowRankCodec(2).reduce(torch.randn(n), 1.0, None, 0, full, shapes).wait()
    assert sum(r.payload_bytes for r in full.records) == sum(r.payload_bytes for r in wire.records)


def test_lowrank_bf16_without_exact_spans_sends_the_count_alone_in_float32() -> None:
    """The count of ranks the sum holds (DDP's join) stays exact at any world size in
    float32, where a bf16 sum of ones is exact only up to 256; launched beside P's."""
    wire = LocalWire()
    codec = LowRankCodec(2, factor_dtype=torch.bfloat16)
    codec.reduce(torch.randn(48 * 40), 1.0, None, 0, wire, [torch.Size((48, 40))]).wait()
    assert [(r.dtype, r.payload_bytes) for r in wire.records] == [
        ("torch.float32", 4),
        ("torch.bfloat16", 2 * 48 * 2),
        ("torch.bfloat16", 2 * 40 * 2),
    ]


SHADOW_LEVELS = [
    "none", "bf16", "int8", "int8:64", "topk:0.1", "lowrank:2", "lowrank-bf16:2",
    "lowrank:2:1", "lowrank:2:1:exact",
]  # fmt: skip


@pytest.mark.parametrize("level", SHADOW_LEVELS)
def test_a_shadow_pass_sends_what_the_others_send_and_decodes_to_exactly_zero(
    level: str,
) -> None:
    """A rank in a shadow pass of DDP's join: the same collectives with the same shapes as a
    rank that trained (or gloo hangs), a contribution of exactly 0, and nothing of its own
    error feedback (the hook keeps that)."""
    shapes = [torch.Size((48, 40)), torch.Size((40,))]
    n = 48 * 40 + 40
    trained, shadow = make_codec(level), make_codec(level)
    for _ in range(2):  # through lowrank's warm-up step
        sent, sat_out = LocalWire(), LocalWire()
        trained.reduce(torch.randn(n), 0.5, torch.randn(n), 3, sent, shapes).wait()
        out = shadow.reduce_shadow(torch.zeros(n), 3, sat_out, shapes).wait()
        assert [(r.op, r.dtype, r.payload_bytes) for r in sat_out.records] == [
            (r.op, r.dtype, r.payload_bytes) for r in sent.records
        ]
        assert torch.equal(out.summed, torch.zeros(n))
