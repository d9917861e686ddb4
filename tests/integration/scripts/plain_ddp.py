"""A plain DDP training script that imports nothing of ours (for the zero-code test)."""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    if step >= args.steps:
        break
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
dist.destroy_process_group()
