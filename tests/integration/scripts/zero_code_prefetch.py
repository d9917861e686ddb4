"""A DDP script that imports nothing of trainspec: two epochs of a loop that reads one batch
ahead (a prefetcher) over 10 samples a rank in batches of 4 (4, 4, 2), then an evaluation
over a DataLoader whose batches are read with gradients on, then 3 steps on tensors in
memory of 6 samples each: samples per step [4, 4, 2, 4, 4, 2, 6, 6, 6] on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
sampler = DistributedSampler(data, shuffle=False)
loader = DataLoader(data, batch_size=4, sampler=sampler)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(2):  # epochs
    it = iter(loader)
    batch = next(it)
    while batch is not None:
        nxt = next(it, None)  # read ahead, as a prefetcher does
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        batch = nxt
held_out = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
for (v,) in held_out:  # read with gradients on, evaluated under no_grad
    with torch.no_grad():
        model(v)
inputs, targets = torch.randn(6, 4), torch.randn(6, 1)
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
