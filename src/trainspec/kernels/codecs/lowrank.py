"""Level `lowrank:R[:W[:WARM]]`: PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019),
rank R, after W warm-up steps of block-scaled int8 (WARM `int8`, the default) or of exact
float32 sums (WARM `exact`).

Per bucket, every parameter of two or more dimensions is viewed as a matrix M (rows = first
dimension, in the order the bucket holds its values: `residual_layout.bucket_shapes`) and replaced by a rank-R product P Q^T from one step of subspace iteration:
orthonormalise Q, P = sum_r M_r Q, orthonormalise P, Q = sum_r M_r^T P. Q is kept for the
next step (warm start), starting from the same seeded Gaussian on every rank. Orthonormalising
Q first, as torch's hook does, changes nothing in exact arithmetic (span(M Q R^-1) =
span(M Q), R triangular) but does in float32: a kept Q's columns scale with M's singular
values, so without it P = M Q has about the square of M's condition number and its QR
loses the trailing directions' digits. Fed the same gradients as torch's hook
(tests/integration/test_lowrank_matches_torch.py), ours was 3-5x further than torch's from
a float64 PowerSGD on TinyGPT without it (up to 20x on some matrices, e.g. the MLP's output
projection), and is as close with it. Vectors (biases, norms) and matrices too small to
gain, those with R * (rows + cols) >= rows * cols, are summed exactly in the same
all-reduce as P (torch's hook sends them uncompressed too). Error feedback:
each rank keeps M_r - P Q^T / C, C the ranks whose M_r the sum holds, so the residuals over
ranks add up to exactly what the low-rank sum missed. Every value the sum is built from (the
summed P, the summed Q) is the same on every rank, so the decoded sum, and with it the
residuals' total, is exact whatever Q each rank started from.

C is W but on a step some rank sits out in a shadow pass of DDP's `join()` (its data ran
out; `reduce_shadow`): that rank sends zero factors, which add exactly nothing to the sums,
and keeps no residual of the step, so the credit is shared by the C = W - k ranks that
trained it (with 1 / W each, k / W of the approximation was owed to nobody: the residuals
of the ranks that trained were 0.2-2x their size off in tests/integration/
test_hook_join_exact.py, 2026-11-28). Each rank counts itself in with a float32 1.0 (0.0
in a shadow pass) at the end of the step's first float32 all-reduce: 4 bytes a bucket with
a compressed matrix, no collective of its own, and the count at hand when the bucket is
decoded. The statistics' all-reduce (the hook's flags) also tells the ranks that trained,
but at a chained level it runs after the step's last bucket is decoded, so every residual
would have to be corrected afterwards.

Warm-up (W > 0): the first W steps of each bucket go through `Int8Codec` (error feedback
included), as 1-bit Adam (Tang et al. 2021) runs its first steps uncompressed so that
Adam's second moments form from exact gradients; int8 is within 1% of float32 on our
workload at a quarter of its bytes, so the warm-up can be several times longer for the
same bytes. Meanwhile Q follows the decoded int8 sums by one local subspace-iteration step
per step (no communication: every rank decodes the same sum), so PowerSGD starts from the
gradients' leading subspace instead of a random one. The warm-up restarts after `reset()`.
The int8 all-gather saves bytes only below 8 ranks (see int8.py); on larger worlds warm up
exactly instead.

`exact` warm-up (`lowrank:R:W:exact`) sends the first W steps uncompressed and starts
PowerSGD from the seeded Q, as torch's `powerSGD_hook` does with `start_powerSGD_iter=W`
(tracking Q through exact steps was tried: no difference beyond chance over ten seeds,
and it costs a QR per matrix per step). Over ten seeds (bench/compression_seeds.py,
docs/benchmarks.md) the int8 warm-up ended 2.6-4% above `none` on one seed at 120 steps
whatever the rank or Q start, and the same seed nudged by one float32 step did too (not
chaos); three exact steps did not. A guess, not measured:
int8's block scales zero a block's small entries in the first steps, so Adam's second
moments for them form from zeros and the owed gradient later arrives through a tiny
denominator, the variance problem 1-bit Adam's exact warm-up avoids.

Two all-reduces per bucket, the second launched from the first one's continuation; the
hook serialises buckets so every rank launches them in the same order.

Level `lowrank-bf16:R[:W]`: the same with P and Q sent in bfloat16 (the wire sums them in
bfloat16), so a rank-2R step costs what a float32 rank-R step does. The exact spans and
the count C go in their own float32 all-reduce, launched beside P's (the count alone, 4
bytes, in a bucket without exact spans: a bf16 sum of ones is exact only to 256 ranks).
Decoded factors are widened to float32 before anything else: P's sum is orthonormalised
in float32, Q is computed from that P in float32, and the decoded sum is P Q^T from the
factors as they arrived. Error feedback is therefore taken against what was really
applied: each rank keeps M_r - P Q^T / C with the rounded factors, the residuals over ranks add up to exactly what the applied sum missed,
bf16 rounding of P and Q included, and the next steps send it (the rounding of P only
tilts the subspace; the rounding of Q is owed and repaid).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import torch

from trainspec.kernels.codecs.base import Codec, CodecResult, weighted
from trainspec.kernels.codecs.int8 import Int8Codec
from trainspec.kernels.codecs.none import NoneCodec
from trainspec.kernels.wire import Wire, chain, completed, follow, future_devices
from trainspec.levels import WARMUP_KINDS

# The two wire formats of the factors, by level kind.
FACTOR_DTYPES = {"lowrank": torch.float32, "lowrank-bf16": torch.bfloat16}


_SEED = 0x5EED  # the same on every rank: the warm-start Q must agree everywhere
MAX_SEED = 1 << 31


def _q_seed(cols: int, seed: int) -> int:
    """The generator seed of a Q with `cols` rows. Seed 0 is the start every figure before
    the seed existed was measured from; others hash (seed, cols) into the 32 bits the CPU
    generator keeps (it drops higher bits: `seed << 40` would change nothing)."""
    return _SEED + cols if seed == 0 else zlib.crc32(f"{seed}/{cols}".encode())


# (offset, rows, cols, slot) of each compressed matrix; (offset, length) of each exact span
_Matrices = list[tuple[int, int, int, int]]
_Spans = list[tuple[int, int]]
# The first round's sums: the exact spans, P (float32), C (the ranks counted, one value)
_FirstRound = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _matrix_shape(shape: torch.Size) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    return rows, cols


class LowRankCodec(Codec):
    uses_error_feedback = True
    plans_by_shape = True

    def __init__(
        self,
        rank: int,
        warmup_steps: int = 0,
        warmup_block: int = 256,
        factor_dtype: torch.dtype = torch.float32,
        warmup_kind: str = "int8",
        seed: int = 0,
    ) -> None:
        """`seed` picks the starting Q (the same on every rank), as torch's
        `PowerSGDState.random_seed` does; 0 <= seed < 2^31."""
        if rank < 1:
            raise ValueError(f"lowrank rank must be >= 1, got {rank}")
        if warmup_steps < 0:
            raise ValueError(f"lowrank warm-up steps must be >= 0, got {warmup_steps}")
        if warmup_kind not in WARMUP_KINDS:
            raise ValueError(f"lowrank warm-up is int8 or exact, got {warmup_kind!r}")
        if not 0 <= seed < MAX_SEED:
            raise ValueError(f"lowrank seed must be in [0, {MAX_SEED}), got {seed}")
        self.seed = seed
        kinds = {dtype: kind for kind, dtype in FACTOR_DTYPES.items()}
        if factor_dtype not in kinds:
            raise ValueError(f"lowrank factors go in float32 or bfloat16, got {factor_dtype}")
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.factor_dtype = factor_dtype
        kind = kinds[factor_dtype]
        self.warmup_kind = warmup_kind
        suffix = "" if warmup_kind == "int8" else f":{warmup_kind}"
        self.level = f"{kind}:{rank}:{warmup_steps}{suffix}" if warmup_steps else f"{kind}:{rank}"
        self._warmup: Codec = (
            NoneCodec() if warmup_kind == "exact" else Int8Codec(block_size=warmup_block)
        )
        self._qs: dict[tuple[int, int], torch.Tensor] = {}  # (bucket key, slot) -> Q
        # Steps since construction / reset. A step begins when a bucket key comes back: DDP
        # reduces each bucket once per step but rebuilds its buckets after step 0, so a
        # per-key count would let a bucket new at step 1 warm up one step longer than the rest.
        self._steps = 0
        self._keys_this_step: set[int] = set()

    def reset(self) -> None:
        self._qs.clear()
        self._steps = 0
        self._keys_this_step.clear()

    def forget_warm_starts(self) -> None:
        self._qs.clear()  # each Q starts again from the seed, alike on every rank

    def _initial_q(self, cols: int, device: torch.device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_q_seed(cols, self.seed))
        return torch.randn(cols, self.rank, generator=gen).to(device)

    def _q(self, key: int, slot: int, cols: int, device: torch.device) -> torch.Tensor:
        """The matrix's starting Q for this step, orthonormalised (kept ones are not)."""
        q = self._qs.get((key, slot))
        if q is None or q.shape != (cols, self.rank):
            q = self._initial_q(cols, device)
        return torch.linalg.qr(q).Q

    def _plan(self, n: int, shapes: Sequence[torch.Size] | None) -> tuple[_Matrices, _Spans]:
        """Split the flat bucket into compressed matrices and exact spans. `shapes` as the hook
        gives them: a complex parameter's real view (`residual_layout.bucket_shapes`), so a
        complex matrix is planned as shape[0] x (2 x the rest) real values, and a complex
        vector as 2 x numel values sent exactly."""
        if not shapes:
            shapes = [torch.Size([n])]
        matrices: _Matrices = []
        exact: _Spans = []
        offset = 0
        for slot, shape in enumerate(shapes):
            size = shape.numel()
            mat = _matrix_shape(shape)
            if mat is not None and self.rank * (mat[0] + mat[1]) < size:
                matrices.append((offset, mat[0], mat[1], slot))
            else:
                exact.append((offset, size))
            offset += size
        if offset != n:
            raise ValueError(f"parameter shapes cover {offset} values, bucket has {n}")
        return matrices, exact

    def reduce(
        self,
        grad: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        matrices, exact = self._plan(grad.numel(), shapes)  # raises on a bad layout
        self._count_step(key)
        if self._steps < self.warmup_steps:
            fut = self._warmup.reduce(grad, weight, residual, key, wire, shapes)
            if self.warmup_kind == "exact":
                return fut  # torch's schedule exactly: PowerSGD then starts from the seeded Q
            track = functools.partial(self._track, key=key, matrices=matrices)
            return follow(fut, track, future_devices(grad))
        return self._power_step(weighted(grad, weight, residual), key, wire, matrices, exact)

    def reduce_shadow(
        self,
        grad: torch.Tensor,
        key: int,
        wire: Wire,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.futures.Future:
        """Zero factors and spans (zeros times any Q are zeros), and a count of 0: the ranks
        that trained the step take the whole credit. Its warm starts and step count move as
        every rank's do (they are built from the sums alone)."""
        matrices, exact = self._plan(grad.numel(), shapes)
        self._count_step(key)
        if self._steps < self.warmup_steps:
            fut = self._warmup.reduce_shadow(grad, key, wire, shapes)
            if self.warmup_kind == "exact":
                return fut
            track = functools.partial(self._track, key=key, matrices=matrices)
            return follow(fut, track, future_devices(grad))
        zeros = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        return self._power_step(zeros, key, wire, matrices, exact, trained=False)

    def _count_step(self, key: int) -> None:
        """A step begins when a bucket key comes back (see `__init__`)."""
        if key in self._keys_this_step:
            self._steps += 1
            self._keys_this_step.clear()
        self._keys_this_step.add(key)

    def _track(self, result: CodecResult, key: int, matrices: _Matrices) -> CodecResult:
        """One subspace-iteration step of Q on the decoded warm-up sum, locally."""
        for o, r, c, slot in matrices:
            m = result.summed[o : o + r * c].view(r, c)
            p = torch.linalg.qr(m @ self._q(key, slot, c, m.device)).Q
            self._qs[(key, slot)] = m.t() @ p
        return result

    def _power_step(
        self,
        contrib: torch.Tensor,
        key: int,
        wire: Wire,
        matrices: _Matrices,
        exact: _Spans,
        *,
        trained: bool = True,
    ) -> torch.futures.Future:
        """One PowerSGD step of the bucket `contrib`; `trained` False in a shadow pass
        (`reduce_shadow`: `contrib` is zeros and this rank is not counted in C)."""
        mats = [contrib[o : o + r * c].view(r, c) for o, r, c, _ in matrices]
        qs = [self._q(key, slot, c, contrib.device) for _, _, c, slot in matrices]
        ps = [m @ q for m, q in zip(mats, qs, strict=True)]
        exact_flat = [contrib[o : o + s] for o, s in exact]
        # This rank's count in C, the ranks the sum holds (float32: exact to 2^24 ranks)
        count = torch.full(
            (1,), 1.0 if trained else 0.0, dtype=torch.float32, device=contrib.device
        )

        def after_p(summed: _FirstRound) -> torch.futures.Future:
            summed_exact, summed_p, credited = summed
            p_hats = []
            off = 0
            for p in ps:
                p_sum = summed_p[off : off + p.numel()].view_as(p)
                off += p.numel()
                p_hats.append(torch.linalg.qr(p_sum).Q)
            new_qs = [m.t() @ ph for m, ph in zip(mats, p_hats, strict=True)]

            def finish(summed_second: torch.Tensor) -> CodecResult:
                out = torch.empty_like(contrib)
                off_e = 0
                for o, s in exact:
                    out[o : o + s] = summed_exact[off_e : off_e + s]
                    off_e += s
                off_q = 0
                for (o, r, c, slot), ph in zip(matrices, p_hats, strict=True):
                    q_sum = summed_second[off_q : off_q + c * self.rank].view(c, self.rank)
                    off_q += c * self.rank
                    self._qs[(key, slot)] = q_sum.clone()
                    out[o : o + r * c] = (ph @ q_sum.t()).reshape(-1)
                # Exact spans leave no residual; matrices keep M_r - P Q^T / C, with P and Q
                # as decoded (bf16 rounding included). C on the device: no host sync on CUDA.
                new_residual = contrib - out / credited.clamp_min(1.0)
                for o, s in exact:
                    new_residual[o : o + s] = 0.0
                return CodecResult(out, new_residual)

            if not new_qs:
                return completed(finish(contrib.new_empty(0)), future_devices(contrib))
            second = torch.cat([q.reshape(-1) for q in new_qs]).to(self.factor_dtype)
            return wire.all_reduce(second, then=lambda summed: finish(_widen(summed)))

        first = self._send_first(exact_flat, ps, count, wire)
        return chain(first, after_p, future_devices(contrib))

    def _send_first(
        self,
        exact_flat: list[torch.Tensor],
        ps: list[torch.Tensor],
        count: torch.Tensor,
        wire: Wire,
    ) -> torch.futures.Future:
        """All-reduce the exact spans, P and the ranks' `count` (one float32 each); the value
        is (summed exact, summed P in float32, C as a one-value tensor).

        Float32 factors share one all-reduce with the exact spans and the count. Bfloat16
        factors cannot, so the exact spans and the count (float32) go first, then P
        (bfloat16), both launched here, in the same order on every rank. A bucket without a
        compressed matrix sends no count: it keeps no residual to share out.
        """
        exact_len = sum(t.numel() for t in exact_flat)
        p_flat = [p.reshape(-1) for p in ps]
        if not ps:
            return wire.all_reduce(torch.cat(exact_flat), then=lambda t: (t, t[:0], count))
        if self.factor_dtype == torch.float32:
            first = torch.cat([*exact_flat, *p_flat, count])
            return wire.all_reduce(first, then=lambda t: (t[:exact_len], t[exact_len:-1], t[-1:]))
        futs = [
            wire.all_reduce(torch.cat([*exact_flat, count])),
            wire.all_reduce(torch.cat(p_flat).to(self.factor_dtype)),
        ]

        def split(done: list[torch.futures.Future]) -> _FirstRound:
            spans, summed_p = (f.value() for f in done)
            return spans[:exact_len], _widen(summed_p), spans[exact_len:]

        # collect_all passes a collective's error on as it is
        return follow(torch.futures.collect_all(futs), split, future_devices(p_flat[0]))


def _widen(t: torch.Tensor) -> torch.Tensor:
    """Decoded factors in float32: orthonormalisation and products never run in bf16."""
    return t.to(torch.float32)
