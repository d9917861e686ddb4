"""Train the reference TinyGPT with trainspec: the complete, explicit integration example.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 100

Runs on CPU with gloo or on CUDA with NCCL (one GPU per rank). Everything trainspec does is
in the lines marked `trainspec:`; remove them and this is a plain DDP training script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

import trainspec
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--run-root", default=None, help="runs root (default: config store.root)")
    p.add_argument("--timings", default=None, help="rank 0 writes its step times here (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores

    cfg = GPTConfig(block_size=args.block_size, n_layer=args.layers, n_embd=args.embd)
    ts = trainspec.init(  # trainspec: collector, side groups, run store
        run_root=args.run_root,
        device=device,
        flops_per_sample=cfg.flops_per_token() * args.block_size,
    )
    model = TinyGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model = ts.wrap(model, optimizer=optimizer)  # trainspec: DDP + gradient hook

    dataset = StdlibTextDataset(block_size=args.block_size)
    world, rank = ts.identity.world_size, ts.identity.rank
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step = 0
    epoch = 0
    step_times: list[float] = []
    started = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in ts.iter_data(loader):  # trainspec: data wait
            if step >= args.steps:
                break
            t_step = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with ts.step(samples=x.shape[0], tokens=x.numel()) as s:  # trainspec: step
                optimizer.zero_grad(set_to_none=True)
                with s.phase("forward"):
                    _, loss = model(x, y)
                with s.phase("backward"):
                    loss.backward()
                with s.phase("optimizer"):
                    optimizer.step()
                s.loss = loss
            step_times.append(time.perf_counter() - t_step)
            step += 1
        epoch += 1
    wall = time.perf_counter() - started
    collector_cpu = ts.collector.cpu_seconds() if ts.collector is not None else 0.0
    ts.close()  # trainspec: flush, every rank in step
    if args.timings and ts.identity.rank == 0:
        record = {"step_times": step_times, "wall_s": wall, "collector_cpu_s": collector_cpu}
        Path(args.timings).write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
