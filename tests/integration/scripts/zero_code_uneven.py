"""A plain DDP script (nothing of ours imported) whose steps all-reduce more than once, then
whose ranks run out of data unevenly under `ddp.join()`, twice (two epochs). Each step it
prints `{"rank", "step", "passes", "gn"}` (gn: the all-reduced gradient's norm) as JSON.

Steps 0-1 accumulate 3 micro-batches without `no_sync` (each backward all-reduces); then
each epoch rank 0 trains 4 steps and rank 1 2, rank 1 shadowing rank 0's last 2 in its join.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
step = 0


def train(passes: int) -> None:
    global step
    for _ in range(passes):  # every pass all-reduces
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        (nn.functional.mse_loss(model(x), y) / passes).backward()
    gn = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    opt.step()
    opt.zero_grad()
    # one write per line: both ranks print to the same pipe
    print(json.dumps({"rank": rank, "step": step, "passes": passes, "gn": gn.item()}) + "\n",
          end="", flush=True)  # fmt: skip
    step += 1


for _ in range(2):
    train(3)
for _epoch in range(2):
    with model.join():
        for _ in range(4 if rank == 0 else 2):
            train(1)
dist.destroy_process_group()
