"""One rank of a job that trains two identical DDP models on the same batches, each with
trainspec's hook: one through a GradScaler whose scale doubles at every step (growth
interval 1), one without. Scaling by a power of two is exact in float32, so both see the same
gradients up to the scale; their noise-scale EMAs must agree. Rank 0 writes both series to
argv[1]."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainspec.kernels.hook import CompressionHook
from trainspec.runtime import loss_scale

STEPS = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    loss_scale.install()
    plain, scaled = (torch.nn.parallel.DistributedDataParallel(model()) for _ in range(2))
    hooks = [CompressionHook(local_batch_size=8), CompressionHook(local_batch_size=8)]
    hooks[1].loss_scale = loss_scale.current  # as hook_wiring sets it
    for ddp, hook in zip((plain, scaled), hooks):
        hook.register(ddp)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, scaled)]
    gen = torch.Generator().manual_seed(1 + rank)
    noise: dict[str, list] = {"plain": [], "scaled": [], "scales": []}
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        noise["scales"].append(scaler.get_scale())
        scaler.scale(torch.nn.functional.mse_loss(scaled(x), y)).backward()
        scaler.step(opts[1])
        scaler.update()
        opts[1].zero_grad()
        loss_scale.take()  # what the session does at each step's end
        for name, hook in zip(("plain", "scaled"), hooks):
            noise[name].append(hook.latest_stats().grad_noise_scale)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(noise, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
