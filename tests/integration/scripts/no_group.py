"""Launched by torchrun with two ranks, but makes no process group at first: rank 0 trains
three steps, rank 1 one (each alone); with argv[1] "late" both then make the script's own
group. Imports nothing of trainspec."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(1.0)  # rank 0 trains alone meanwhile
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3 if rank == 0 else 1):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
if len(sys.argv) > 1 and sys.argv[1] == "late":
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
