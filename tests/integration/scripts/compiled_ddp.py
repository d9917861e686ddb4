"""A script that imports nothing of trainspec and trains a torch.compile'd DDP model (the
aot_eager backend: Dynamo's tracing without a C++ compiler) for 10 steps of 4 samples."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model = torch.compile(torch.nn.parallel.DistributedDataParallel(net), backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for (x,) in DataLoader(TensorDataset(torch.randn(40, 16)), batch_size=4):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
print(f"rank {dist.get_rank()} done", flush=True)  # one write: ranks share the pipe
dist.destroy_process_group()
