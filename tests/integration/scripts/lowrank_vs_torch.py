"""One rank of a job that runs our `lowrank:R:W:exact` and torch's `powerSGD_hook` (rank R,
`start_powerSGD_iter=W`, error feedback, warm start) side by side, step for step, on two
copies of one model fed the same batches, and compares the averaged gradient each hook hands
back to DDP (param.grad after backward).

Both hooks start PowerSGD from the same Q: each matrix of ours is given torch's own draw for
that parameter (torch seeds its generator from `PowerSGDState.rng` once per bucket, at the
bucket's first PowerSGD step, and draws one Gaussian per matrix, the matrices grouped by
shape). Torch orthonormalises a Q before P = M Q; span(M Q R^-1) = span(M Q) for the
triangular R of Q's QR, so a hook that did not would still find the same P up to column
signs, which P Q^T does not see: only the float32 rounding differs.

`--mode forced` (the comparison): after each step model B (ours) takes model A's (torch's)
weights, so both hooks see bitwise the same local gradients every step and only the hooks'
own state (Q, residuals) can drift apart. `--mode free`: each model trains on its own
(AdamW), as the benchmark does: `--model gpt --mode free --global-loss --seed S --q-seed K
--batch-size 16 --matrix-rank 6` trains torch's model exactly as bench/compression.py's
`torch:powersgd:6@3+qK` at `--seed S` does (same final loss), beside ours from the same Q.
`--reference` also runs PowerSGD in float64 from the all-gathered local gradients (forced
mode), the exact algorithm both float32 hooks round.

Torch's hook gets one bucket (its later all-reduces are launched from continuations, and with
several buckets gloo ranks can enqueue them in different orders and abort); ours gets DDP's
buckets of `--ours-bucket-cap-mb` (default: one too). Rank 0 writes JSON to argv[1].
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels import CompressionHook
from trainspec.kernels.codecs.lowrank import LowRankCodec
from trainspec.kernels.teardown import collect_at_exit, keep_until_exit

Batch = Callable[[int, int, int, int, int], tuple[torch.Tensor, torch.Tensor]]


class Small(torch.nn.Module):
    """An embedding, Linear layers with biases, a layer norm and a layer too small to
    compress: every kind of tensor the hook splits into compressed matrices and exact spans."""

    def __init__(self, vocab: int = 64, width: int = 48, hidden: int = 192) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, vocab)
        self.tiny = torch.nn.Linear(width, 4)  # too small to compress at rank >= 3

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        logits = self.out(x) + self.tiny(x).sum(-1, keepdim=True)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        )


def _small() -> tuple[Callable[[], torch.nn.Module], Batch]:
    def batch(step: int, rank: int, world: int, size: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        idx = torch.randint(0, 64, (size, 16), generator=gen)
        return idx, (idx * 7 + 3) % 64  # the next token is a fixed function of this one

    return Small, batch


def _gpt(small: bool) -> tuple[Callable[[], torch.nn.Module], Batch]:
    """The reference workload (TinyGPT on StdlibTextDataset, as bench/compression.py feeds
    it), or the same model at 1 layer, width 64, context 32 (`gpt-small`)."""
    from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT

    cfg = GPTConfig(block_size=32, n_layer=1, n_embd=64) if small else GPTConfig()
    data = StdlibTextDataset(cfg.block_size, 200_000 if small else 2_000_000)

    class LossOnly(TinyGPT):
        def forward(self, idx, targets):  # type: ignore[override]
            return super().forward(idx, targets)[1]

    def batch(step: int, rank: int, world: int, size: int, seed: int):
        first = (step * world + rank) * size + seed * 100_003
        xs, ys = zip(*(data[(first + i) % len(data)] for i in range(size)), strict=True)
        return torch.stack(xs), torch.stack(ys)

    return lambda: LossOnly(cfg), batch


def _compressed(shape: torch.Size, rank: int) -> bool:
    """Ours compresses a matrix when R (rows + cols) < rows cols (torch's rule at
    `min_compression_rate=1`)."""
    if len(shape) < 2:
        return False
    rows, cols = shape[0], shape.numel() // shape[0]
    return rank * (rows + cols) < rows * cols


class TorchDraws:
    """Torch's starting Q of every compressed parameter, by id(parameter of model A), replayed
    from a copy of `state.rng` taken before its first PowerSGD step. Torch's hook is wrapped
    to record its buckets' parameters (`hook`)."""

    def __init__(self, state: torch_psgd.PowerSGDState) -> None:
        self.rng = np.random.RandomState()
        self.rng.set_state(state.rng.get_state())
        self.rank = state.matrix_approximation_rank
        self.buckets: dict[int, list[torch.Tensor]] = {}
        self.by_param: dict[int, torch.Tensor] = {}

    def hook(self, state, bucket):  # unannotated: DDP checks real annotations' classes
        self.buckets[bucket.index()] = bucket.parameters()
        return torch_psgd.powerSGD_hook(state, bucket)

    def draw(self) -> None:
        """After torch's first PowerSGD step: it drew each bucket's Qs in index order."""
        for index in sorted(self.buckets):
            by_shape: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
            for p in self.buckets[index]:
                if _compressed(p.shape, self.rank):
                    by_shape[(p.shape[0], p.numel() // p.shape[0])].append(p)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for (_, cols), group in by_shape.items():
                    for p in group:
                        self.by_param[id(p)] = torch.randn(1, cols, self.rank)[0]


def give_torch_draws(
    hook: CompressionHook, draws: TorchDraws, twin: dict[int, torch.Tensor]
) -> None:
    """Start each of our matrices from torch's draw for the same parameter (`twin`: id of
    our parameter -> torch's model's). Our bucket layout may differ from torch's."""
    codec = hook._codec
    assert isinstance(codec, LowRankCodec)
    ours_buckets: dict[int, list[torch.Tensor]] = {}
    on_bucket = hook.on_bucket
    power_step = codec._power_step

    def recording(bucket: dist.GradBucket):
        ours_buckets[bucket.index()] = bucket.parameters()
        return on_bucket(bucket)

    def seeded(contrib, key, wire, matrices, exact):
        if not draws.by_param:
            draws.draw()
        for *_, slot in matrices:
            if (key, slot) not in codec._qs:
                theirs = twin[id(ours_buckets[key][slot])]
                codec._qs[(key, slot)] = draws.by_param[id(theirs)].clone()
        return power_step(contrib, key, wire, matrices, exact)

    hook.on_bucket = recording  # type: ignore[method-assign]
    codec._power_step = seeded  # type: ignore[method-assign]


class Reference:
    """PowerSGD as torch's hook computes it, in float64, from every rank's local gradient."""

    def __init__(self, shapes: list[torch.Size], rank: int, start: int, world: int) -> None:
        self.shapes, self.rank, self.start, self.world = shapes, rank, start, world
        self.qs: dict[int, torch.Tensor] = {}  # parameter index -> Q, set from torch's draws
        self.err: list[list[torch.Tensor]] | None = None
        self.step = 0

    def __call__(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """grads[rank][parameter] -> the averaged gradient of each parameter."""
        step, self.step = self.step, self.step + 1
        n = len(self.shapes)
        if step < self.start:
            return [sum(g[i] for g in grads) / self.world for i in range(n)]
        if self.err is None:
            self.err = [[torch.zeros_like(t) for t in g] for g in grads]
        ms = [[g[i] + e[i] for i in range(n)] for g, e in zip(grads, self.err, strict=True)]
        out = []
        for i, shape in enumerate(self.shapes):
            if not _compressed(shape, self.rank):
                out.append(sum(m[i] for m in ms) / self.world)
                continue
            mats = [m[i].reshape(shape[0], -1) for m in ms]
            q = torch.linalg.qr(self.qs[i]).Q
            p = torch.linalg.qr(sum(m @ q for m in mats)).Q
            self.qs[i] = sum(m.t() @ p for m in mats) / self.world
            out.append((p @ self.qs[i].t()).reshape(shape))
        self.err = [[m[i] - out[i] for i in range(n)] for m in ms]
        return out


def _rel(exact: torch.Tensor, other: torch.Tensor) -> float:
    """|other - exact| / |exact| (L2); the plain difference where exact is 0."""
    denom = exact.norm().item()
    diff = (exact - other).norm().item()
    return diff / denom if denom > 0 else diff


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=16)
    # (no option may be a prefix of one of torchrun's: its parser reads the script's too)
    p.add_argument("--matrix-rank", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--model", choices=["gpt", "gpt-small", "small"], default="gpt-small")
    p.add_argument("--mode", choices=["forced", "free"], default="forced")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-bucket-cap-mb", type=float, default=64.0)
    p.add_argument("--reference", action="store_true", help="also PowerSGD in float64 (forced)")
    p.add_argument("--global-loss", action="store_true", help="losses averaged over ranks")
    p.add_argument("--q-seed", type=int, default=0, help="torch's random_seed as bench's +qK")
    p.add_argument(
        "--raw-q", action="store_true",
        help="ours as before 2026-11-27: P = M Q from the kept Q, not orthonormalised",
    )  # fmt: skip
    args = p.parse_args()

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    collect_at_exit()
    rank, world = dist.get_rank(), dist.get_world_size()
    # One group per hook: neither hook's collectives can meet the other's.
    g_torch = dist.new_group(backend="gloo", timeout=timeout)
    g_ours = dist.new_group(backend="gloo", timeout=timeout)
    make, batch = _small() if args.model == "small" else _gpt(args.model == "gpt-small")
    torch.manual_seed(args.seed)
    model_a, model_b, model_c = make(), make(), make()
    model_b.load_state_dict(model_a.state_dict())
    ddp_a = DDP(model_a, process_group=g_torch, bucket_cap_mb=64.0)
    ddp_b = DDP(model_b, process_group=g_ours, bucket_cap_mb=args.ours_bucket_cap_mb)
    state = torch_psgd.PowerSGDState(
        process_group=g_torch,
        matrix_approximation_rank=args.matrix_rank,
        start_powerSGD_iter=args.warmup_steps,
        min_compression_rate=1,  # ours' rule (`_compressed`)
        use_error_feedback=True,
        warm_start=True,
        random_seed=(args.seed + 1_000_003 * args.q_seed) % 2**32,  # bench/compression.py's
    )
    draws = TorchDraws(state)
    ddp_a.register_comm_hook(state, draws.hook)
    keep_until_exit(g_torch)  # freed at exit, as `hook.register` does ours (teardown.py)
    level = f"lowrank:{args.matrix_rank}:{args.warmup_steps}:exact"
    hook = CompressionHook(level, group=g_ours, local_batch_size=args.batch_size)
    hook.register(ddp_b)
    params_a, params_b = list(model_a.parameters()), list(model_b.parameters())
    give_torch_draws(hook, draws, dict(zip(map(id, params_b), params_a, strict=True)))
    if args.raw_q:
        codec = hook._codec
        assert isinstance(codec, LowRankCodec)

        def raw_q(key: int, slot: int, cols: int, device: torch.device) -> torch.Tensor:
            q = codec._qs.get((key, slot))
            return codec._initial_q(cols, device) if q is None else q

        codec._q = raw_q  # type: ignore[method-assign]
    opt_a = torch.optim.AdamW(ddp_a.parameters(), lr=2e-3)
    opt_b = torch.optim.AdamW(ddp_b.parameters(), lr=2e-3)
    sizes = [q.numel() for q in params_a]
    reference = Reference([q.shape for q in params_a], args.matrix_rank, args.warmup_steps, world)
    rows = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step, rank, world, args.batch_size, args.seed)
        if args.reference:
            model_c.load_state_dict(model_a.state_dict())
            model_c.zero_grad()
            model_c(x, y).backward()
            local = _flat(q.grad for q in model_c.parameters())
            every = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            per_rank = [
                [t.double().view(q.shape) for t, q in zip(g.split(sizes), params_a, strict=True)]
                for g in every
            ]
        losses = []
        for ddp, opt in ((ddp_a, opt_a), (ddp_b, opt_b)):
            opt.zero_grad(set_to_none=True)
            loss = ddp(x, y)
            loss.backward()
            losses.append(loss.item())
        ga, gb = _flat(q.grad for q in params_a), _flat(q.grad for q in params_b)
        per_param = [_rel(a.grad, b.grad) for a, b in zip(params_a, params_b, strict=True)]
        row = {
            "step": step,
            "grad_rel": _rel(ga, gb),
            "worst_param_rel": max(per_param),
            "worst_param": per_param.index(max(per_param)),
            "loss_torch": losses[0],
            "loss_ours": losses[1],
        }
        if args.global_loss:  # the mean over ranks, as bench/compression.py reports it
            both = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(both)
            row["global_loss_torch"], row["global_loss_ours"] = (both / world).tolist()
        if args.reference:
            if step == args.warmup_steps:
                for i, q in enumerate(params_a):
                    if id(q) in draws.by_param:
                        reference.qs[i] = draws.by_param[id(q)].double()
            exact = _flat(reference(per_rank))
            plain = _flat(sum(g[i] for g in per_rank) / world for i in range(len(sizes)))
            row["torch_vs_plain"] = _rel(plain, ga.double())  # what compression changed
            row["torch_vs_f64"] = _rel(exact, ga.double())
            row["ours_vs_f64"] = _rel(exact, gb.double())
            row["per_param_f64"] = [
                (_rel(e, a), _rel(e, b))
                for e, a, b in zip(
                    exact.split(sizes), ga.double().split(sizes), gb.double().split(sizes),
                    strict=True,
                )
            ]  # fmt: skip
        opt_a.step()
        if args.mode == "forced":
            with torch.no_grad():
                for a, b in zip(params_a, params_b, strict=True):
                    b.copy_(a)
        else:
            opt_b.step()
        row["weight_rel"] = _rel(
            _flat(q.detach() for q in params_a), _flat(q.detach() for q in params_b)
        )
        rows.append(row)
    report = {
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
        "args": vars(args),
        "buckets_ours": len(hook._seen),
        "buckets_torch": len(draws.buckets),
        "compressed": sum(_compressed(q.shape, args.matrix_rank) for q in params_a),
        "parameters": len(params_a),
    }
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
