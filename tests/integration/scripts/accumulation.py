"""A script that imports nothing of trainspec and trains with mixed precision's loss scaling
(a GradScaler), accumulating gradients over 4 micro-batches of 2 samples per optimizer step
(DDP's no_sync on the first 3), with an evaluation pass under no_grad over batches of 5 after
every second step and before the first forward of every other step. Its gradients overflow
in steps 1 and 4 of its 6, so the scaler skips the optimizer's step there, as it does
whenever the scale is too high: 6 steps of 8 samples. Each rank prints each step's true
(unscaled) gradient norm."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


def say(line: str) -> None:
    """One write of a whole line: two ranks' prints share a pipe and interleave otherwise."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
train = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=2)
held_out = DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=5)
skipped = 0
for i, (x,) in enumerate(train):
    step, last = divmod(i, 4)[0], i % 4 == 3
    if i % 4 == 0 and step % 2 == 0:  # an evaluation between reading a batch and its forward
        with torch.no_grad():
            for (v,) in held_out:
                model(v)
    with contextlib.nullcontext() if last else model.no_sync():
        loss = model(x).sum()
        if step in (1, 4) and last:
            loss = loss * float("inf")  # an overflow: every rank's gradients are inf
        scaler.scale(loss).backward()
    if last:
        scale = scaler.get_scale()
        scaler.unscale_(opt)  # as gradient clipping does: the true gradient, to compare with
        grads = [p.grad for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        say(f"rank {dist.get_rank()} step {step} norm {norm!r}")
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
        opt.zero_grad()
        if step % 2 == 1:
            with torch.no_grad():
                for (v,) in held_out:
                    model(v)
say(f"rank {dist.get_rank()} skipped {skipped}")
dist.destroy_process_group()
