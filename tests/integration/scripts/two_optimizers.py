"""A script that imports nothing of trainspec and steps two optimizers in each of its 5
training steps (as a GAN or a model and its head do)."""

from __future__ import annotations

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
a = torch.nn.Linear(4, 4)
b = torch.nn.Linear(4, 1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(a, b))
opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
for _ in range(5):
    model(torch.randn(2, 4)).sum().backward()
    opt_a.step()
    opt_b.step()
    opt_a.zero_grad()
    opt_b.zero_grad()
print(f"rank {dist.get_rank()} done", flush=True)  # one write: ranks share the pipe
dist.destroy_process_group()
