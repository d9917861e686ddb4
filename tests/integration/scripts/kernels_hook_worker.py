"""Multi-rank scenarios for the compression hook, run as: python kernels_hook_worker.py
SCENARIO WORLD_SIZE OUT_JSON. Spawns WORLD_SIZE gloo ranks on this host; rank 0 writes the
scenario's measurements to OUT_JSON. Used by tests/integration/test_hook_*.py.

HOOK_WORKER_DEVICE=cuda puts rank r's model and batches on cuda:(r mod GPUs) (the CUDA
paths: Triton kernels, device futures, stream order); HOOK_WORKER_BACKEND=nccl runs the
group on NCCL, one GPU per rank (tests/gpu/)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from datetime import timedelta
from fractions import Fraction
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels import CompressionHook, compression_hook
from trainspec.kernels.codecs.int8 import block_count
from trainspec.kernels.teardown import collect_at_exit
from trainspec.kernels.wire import all_gather_sent_bytes, all_reduce_sent_bytes
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT

CFG = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
BUCKET_MB = 0.02  # several buckets even for this small model
BACKEND = os.environ.get("HOOK_WORKER_BACKEND", "gloo")
DEVICE = torch.device("cpu")  # set per rank in _run


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG).to(DEVICE)


def _batch(data: StdlibTextDataset, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(data[(start + i) % len(data)] for i in range(count)), strict=True)
    return torch.stack(xs).to(DEVICE), torch.stack(ys).to(DEVICE)


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _plain_mean_grad(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: local backward, then a plain float32 all-reduce / W."""
    model.zero_grad()
    model(x, y)[1].backward()
    g = _flat_grads(model).clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def scenario_compare(rank: int, world: int, data: StdlibTextDataset) -> dict:
    out = {}
    x, y = _batch(data, 1000 + 8 * rank, 8)
    reference = _plain_mean_grad(_model(), x, y)
    # Mean over ranks of |g_r|^2, in float64 from the local gradients themselves.
    local = _model()
    local(x, y)[1].backward()
    local_sq = torch.tensor(
        [float(_flat_grads(local).double().square().sum())], dtype=torch.float64, device=DEVICE
    )
    dist.all_reduce(local_sq)
    small_sq = float(local_sq) / world
    for level in (
        "none",
        "bf16",
        "int8",
        "int8:64",
        "lowrank:2",
        "lowrank:8",
        "lowrank-bf16:4",
        "lowrank-bf16:8",
        "topk:0.1",
        "topk:0.5",
        "topk:1.0",
    ):
        ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
        hook = CompressionHook(level, local_batch_size=8)
        hook.register(ddp)
        ddp(x, y)[1].backward()
        got = _flat_grads(ddp.module)
        stats = hook.latest_stats()
        big_sq = float(got.double().square().sum())
        out[level] = {
            "max_abs_diff": float((got - reference).abs().max()),
            "rel_l2_err": float((got - reference).norm() / reference.norm()),
            "ref_max_abs": float(reference.abs().max()),
            # the statistics against the gradient really applied (McCandlish et al., App. A)
            "grad_norm": stats.grad_norm,
            "applied_norm": math.sqrt(big_sq),
            "grad_variance": stats.grad_variance,
            # one rank has no spread across ranks to measure
            "expected_variance": (small_sq - big_sq) / (1 / 8 - 1 / (8 * world))
            if world > 1
            else None,
        }
    return out


def scenario_shares(rank: int, world: int, data: StdlibTextDataset) -> dict:
    shares = [3 + 2 * r for r in range(world)]  # uneven: 3, 5, 7, 9 samples
    total = sum(shares)
    start = sum(shares[:rank])
    x_all, y_all = _batch(data, 500, total)
    full = _model()
    full(x_all, y_all)[1].backward()  # single-process full-batch gradient, on every rank
    expected = _flat_grads(full)
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
    hook = CompressionHook("none")
    hook.set_shares(shares[rank], total)
    hook.register(ddp)
    ddp(x_all[start : start + shares[rank]], y_all[start : start + shares[rank]])[1].backward()
    got = _flat_grads(ddp.module)
    unweighted = _model()  # what plain DDP averaging would have produced
    unweighted(x_all[start : start + shares[rank]], y_all[start : start + shares[rank]])[
        1
    ].backward()
    plain = _flat_grads(unweighted)
    dist.all_reduce(plain)
    plain /= world
    return {
        "max_abs_diff": float((got - expected).abs().max()),
        "plain_ddp_max_abs_diff": float((plain - expected).abs().max()),
        "grad_max_abs": float(expected.abs().max()),
    }


def scenario_switch(rank: int, world: int, data: StdlibTextDataset) -> dict:
    schedule = {0: "none", 8: "int8", 16: "lowrank:2", 24: "bf16", 32: "int8:64",
                40: "topk:0.1", 48: "none"}  # fmt: skip
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
    hook = CompressionHook("none", local_batch_size=8)
    hook.register(ddp)
    errors = _bad_calls(hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses, levels, stats, summaries = [], [], [], []
    pending = sorted(schedule.items())
    for step in range(56):
        # Schedule one switch at a time, as an actuator would, always ahead of time.
        for at, level in pending:
            if at == step + 1:
                hook.set_level(level, at_step=at, reset_error_feedback=(level == "bf16"))
        x, y = _batch(data, 8 * (world * step + rank), 8)
        opt.zero_grad()
        loss = ddp(x, y)[1]
        loss.backward()
        opt.step()
        s = hook.latest_stats()
        summaries.append([hook.step_summary() is s, hook.step_summary() is None])
        losses.append(float(loss.detach()))
        levels.append(s.level)
        stats.append(
            [s.step, s.grad_norm, s.grad_variance, s.grad_noise_scale, s.comm_bytes, s.allreduce_s]
        )
    return {
        "errors": errors,
        "summaries": summaries,
        "losses": losses,
        "levels": levels,
        "stats": stats,
        "param_max_rank_diff": _max_rank_diff(ddp, world),
    }


def _bad_calls(hook: CompressionHook) -> list[str]:
    """Each bad call must raise a one-line error and leave the hook as it was."""
    messages = []
    calls = [
        lambda: hook.set_level("int4"),
        lambda: hook.set_level("int8", at_step=hook.step - 1),
        lambda: CompressionHook.from_config(
            SimpleNamespace(compression="fp8", int8_block_size=256)
        ),
        lambda: hook.set_level("lowrank:0"),
        lambda: hook.set_shares(9, 4),
        lambda: hook.set_shares(1, 0),
    ]
    for call in calls:
        try:
            call()
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    built = CompressionHook.from_config(SimpleNamespace(compression="int8", int8_block_size=64))
    messages.append(f"from_config level {built.level}")
    return messages


def scenario_bytes(rank: int, world: int, data: StdlibTextDataset) -> dict:
    out = {}
    x, y = _batch(data, 8 * rank, 8)
    for level in ("none", "bf16", "int8", "int8:64", "lowrank:2", "lowrank-bf16:4", "topk:0.01"):
        ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
        hook = CompressionHook(level)
        buckets: list[tuple[int, list[list[int]]]] = []

        def recording_hook(state, bucket, buckets=buckets):
            shapes = [list(p.shape) for p in bucket.parameters()]
            buckets.append((bucket.buffer().numel(), shapes))
            return compression_hook(state, bucket)

        ddp.register_comm_hook(hook, recording_hook)
        for _ in range(2):  # step 1 runs on DDP's rebuilt buckets
            buckets.clear()
            ddp(x, y)[1].backward()
        out[level] = {
            "comm_bytes": hook.latest_stats().comm_bytes,
            "records": [
                [r.op, r.dtype, r.payload_bytes, r.sent_bytes] for r in hook.last_step_records
            ],
            "buckets": buckets,
            "expected": _expected_bytes(level, buckets, world),
        }
    return out


def scenario_accumulate(rank: int, world: int, data: StdlibTextDataset) -> dict:
    """A step of one backward, then a step of three without `no_sync` (each pass sends its
    gradients): the step's summary counts every pass's bytes, the last pass alone its own."""
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
    hook = CompressionHook("none", local_batch_size=8)
    hook.register(ddp)
    summaries = []
    for step, passes in enumerate((1, 3)):
        ddp.zero_grad()
        for k in range(passes):
            x, y = _batch(data, 64 * step + 8 * (world * k + rank), 8)
            ddp(x, y)[1].backward()
        s = hook.step_summary()
        summaries.append([s.comm_bytes, s.allreduce_s, hook.latest_stats().comm_bytes,
                          hook.latest_stats().allreduce_s])  # fmt: skip
    return {"summaries": summaries}


def scenario_warmup(rank: int, world: int, data: StdlibTextDataset) -> dict:
    """`lowrank:2:3` under uneven shares: int8 for 3 steps, then PowerSGD, ranks in step."""
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
    hook = CompressionHook("lowrank:2:3")
    shares = [4 + 4 * r for r in range(world)]  # uneven: 4, 8, (12, 16) samples
    hook.set_shares(shares[rank], sum(shares))
    buckets: list[tuple[int, list[list[int]]]] = []

    def recording_hook(state, bucket):
        buckets.append((bucket.buffer().numel(), [list(p.shape) for p in bucket.parameters()]))
        return compression_hook(state, bucket)

    ddp.register_comm_hook(hook, recording_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses, ops, counted, expected = [], [], [], []
    for step in range(8):
        buckets.clear()
        x, y = _batch(data, sum(shares) * step + sum(shares[:rank]), shares[rank])
        opt.zero_grad()
        loss = ddp(x, y)[1]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        ops.append(sorted({r.op for r in hook.last_step_records[:-1]}))  # less the statistics
        counted.append(hook.latest_stats().comm_bytes)
        expected.append(_expected_bytes("int8" if step < 3 else "lowrank:2", buckets, world))
    return {
        "losses": losses,
        "ops": ops,
        "counted": counted,
        "expected": expected,
        "param_max_rank_diff": _max_rank_diff(ddp, world),
    }


def _max_rank_diff(ddp: torch.nn.Module, world: int) -> float:
    """Largest difference between this rank's parameters and any rank's (0: in step)."""
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return max(float((g - flat).abs().max()) for g in gathered)


def _expected_bytes(level: str, buckets: list[tuple[int, list[list[int]]]], world: int) -> int:
    """Independent of the hook: bytes from bucket sizes and each level's wire format."""
    stats = all_reduce_sent_bytes(4 * 8, world)  # [|g_r|^2, 1/n_r, n_r, flags] in float64
    if level == "none":  # the same four values in float32 at the end of the last bucket
        sizes = [n for n, _ in buckets]
        sizes[-1] += 4
        return sum(all_reduce_sent_bytes(4 * n, world) for n in sizes)
    if level == "bf16":
        return stats + sum(all_reduce_sent_bytes(2 * n, world) for n, _ in buckets)
    if level.startswith("int8"):
        block = int(level.split(":")[1]) if ":" in level else 256
        return stats + sum(
            all_gather_sent_bytes(n + 4 * block_count(n, block), world) for n, _ in buckets
        )
    if level.startswith("topk"):  # a float32 value and an int32 index per entry kept
        share = Fraction(level.split(":")[1])  # ceil(F n) in exact arithmetic
        return stats + sum(
            all_gather_sent_bytes(8 * max(1, -(-n * share.numerator // share.denominator)), world)
            for n, _ in buckets
        )
    kind, rank_text = level.split(":")[:2]
    rank_r = int(rank_text)
    factor = 2 if kind == "lowrank-bf16" else 4  # bytes per factor value on the wire
    total = stats
    for _, shapes in buckets:
        exact = p_len = q_len = 0
        for shape in shapes:
            rows, cols = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
            if len(shape) >= 2 and rank_r * (rows + cols) < rows * cols:
                p_len, q_len = p_len + rows * rank_r, q_len + cols * rank_r
            else:
                exact += math.prod(shape)
        # with P, one float32 more: the count of ranks the sum holds (join's shadow passes)
        count = 1 if p_len else 0
        if factor == 4 or not p_len:  # exact values, P and the count in one float32 all-reduce
            total += all_reduce_sent_bytes(4 * (exact + p_len + count), world)
        else:  # exact values and the count in float32, then P in bf16
            total += all_reduce_sent_bytes(4 * (exact + count), world)
            total += all_reduce_sent_bytes(factor * p_len, world)
        if q_len:
            total += all_reduce_sent_bytes(factor * q_len, world)
    return total


def scenario_late_scale(rank: int, world: int, data: StdlibTextDataset) -> dict:
    """The noise-scale EMA under a loss scale that changes every step, with the totals read
    at once or only at the next backward (as on CUDA, kernels/late_stats.py): the same terms,
    since each backward's scale is taken as its totals leave."""
    from trainspec.host_copy import HostValues

    landed = HostValues.ready
    out = {}
    for mode in ("landed", "late"):
        if mode == "late":
            HostValues.ready = lambda self: False  # type: ignore[method-assign]
        ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
        hook = CompressionHook("none", local_batch_size=8)
        hook.register(ddp)
        scale = {"now": 1.0}
        hook.loss_scale = lambda scale=scale: scale["now"]
        for step in range(6):
            scale["now"] = 2.0 ** (10 + step)  # a GradScaler growing every step
            x, y = _batch(data, 8 * (world * step + rank), 8)
            ddp.zero_grad()
            (ddp(x, y)[1] * scale["now"]).backward()
        out[mode] = list(hook.noise_terms() or ())
        HostValues.ready = landed  # type: ignore[method-assign]
    return out


SCENARIOS = {
    "compare": scenario_compare,
    "shares": scenario_shares,
    "switch": scenario_switch,
    "accumulate": scenario_accumulate,
    "bytes": scenario_bytes,
    "warmup": scenario_warmup,
    "late_scale": scenario_late_scale,
}


def _run(rank: int, world: int, store: str, scenario: str, out_path: str) -> None:
    # Scenarios that register `compression_hook` through a recording wrapper skip
    # `hook.register`, and so its collection at exit (kernels/teardown.py): without it a rank
    # aborted at interpreter exit in 4 of 82 runs of `bytes` at 4 ranks, 0 of 60 with it.
    global DEVICE
    collect_at_exit()
    torch.set_num_threads(1)
    if os.environ.get("HOOK_WORKER_DEVICE", "cpu") == "cuda":
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(
        BACKEND,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = SCENARIOS[scenario](rank, world, StdlibTextDataset(CFG.block_size, 300_000))
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(result, fh)
        # Every rank done with its collectives before either tears the group down: a rank
        # that destroys gloo while its peer still has work in flight can abort the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in SCENARIOS:
        print(
            f"usage: kernels_hook_worker.py {{{','.join(SCENARIOS)}}} WORLD_SIZE OUT_JSON",
            file=sys.stderr,
        )
        return 2
    scenario, world, out_path = argv[0], int(argv[1]), argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A file rendezvous: no free-port race with other jobs on the machine.
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_run, args=(world, store, scenario, out_path), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
