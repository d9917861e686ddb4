"""Uneven inputs under DDP's `join()` with the compression hook, 3 gloo ranks: run as
python join_stats_worker.py LEVEL CARRY DIVIDE OUT_DIR (CARRY: 1 carries the statistics in
the last bucket, 0 sends them in an all-reduce of their own; DIVIDE: DDP's
`divide_by_initial_world_size`, 1 or 0).

Rank r trains STEPS[r] steps of SHARES[r] samples (of SUM(SHARES) a step) and then joins:
rank 2 shadows steps 2-4, rank 1 step 4. Every step each rank writes its own gradient (of
its loss on its own batch, computed beside DDP on the same parameters), the gradient DDP
applied, and the hook's statistics of that step, to OUT_DIR/rank<r>.json; the test compares
them with the same figures computed from the ranks that trained the step."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels import CompressionHook

SHARES = (4, 3, 2)
STEPS = (5, 4, 2)
WORLD = len(SHARES)


def _flat(tensors: list[torch.Tensor]) -> list[float]:
    return torch.cat([t.reshape(-1) for t in tensors]).double().tolist()


def _run(rank: int, store: str, level: str, carry: bool, divide: bool, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        # ~1 KB buckets: several buckets, so the statistics' last bucket is not the only one
        model = DDP(net, bucket_cap_mb=0.0005)
        hook = CompressionHook(level, carry_statistics=carry)
        hook.set_shares(SHARES[rank], sum(SHARES))
        hook.register(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        params = list(model.parameters())
        records = []
        with model.join(divide_by_initial_world_size=divide):
            for step in range(STEPS[rank]):
                x = torch.randn(SHARES[rank], 8, generator=gen)
                y = torch.randn(SHARES[rank], 1, generator=gen)
                own = torch.autograd.grad(nn.functional.mse_loss(net(x), y), params)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                stats = hook.latest_stats()
                records.append({
                    "step": step,
                    "hook_step": None if stats is None else stats.step,
                    "own": _flat(list(own)),
                    "applied": _flat([p.grad for p in params]),
                    "grad_norm": None if stats is None else stats.grad_norm,
                    "grad_variance": None if stats is None else stats.grad_variance,
                    "noise_terms": None if stats is None else stats.noise_terms,
                })  # fmt: skip
                opt.step()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "share": SHARES[rank], "records": records}, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    level, carry, divide, out_dir = argv[0], argv[1] == "1", argv[2] == "1", argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_run, args=(store, level, carry, divide, out_dir), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
