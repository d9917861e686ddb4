"""A plain DDP script (nothing of ours imported) that trains slowly, printing each step, and
can fail on one rank: `--sleep S` per step, `--fail RANK:STEP` raises RuntimeError("boom")."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--fail", default=None, help="RANK:STEP at which that rank raises")
args = parser.parse_args()
fail_rank, fail_step = map(int, args.fail.split(":")) if args.fail else (-1, -1)

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    if rank == fail_rank and step == fail_step:
        raise RuntimeError("boom")
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))
    loss.backward()
    opt.step()
    time.sleep(args.sleep)
    # one write per line: both ranks print to the same pipe
    print(f"rank {rank} step {step} pid {os.getpid()}\n", end="", flush=True)
dist.destroy_process_group()
