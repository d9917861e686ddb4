"""DDP training of 10 steps of 8 samples a rank; argv[1]:
- "evaluate": after every 5th step an evaluation under `model.eval()` with gradients on (no
  `no_grad`), 4 batches of 50, then `model.train()`: its batches counted in the step it ran
  in (208 samples) and its time was that step's (QA, 2026-11-27);
- "frozen": training with the model in `eval()` mode throughout (frozen dropout), which is
  training all the same."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

mode = sys.argv[1] if len(sys.argv) > 1 else "evaluate"
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
ds = TensorDataset(torch.randn(160, 32), torch.randn(160, 1))
train = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, seed=1))
val = DataLoader(TensorDataset(torch.randn(200, 32), torch.randn(200, 1)), batch_size=50)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if mode == "frozen":
    model.eval()
for i, (x, y) in enumerate(train):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if mode == "evaluate" and (i + 1) % 5 == 0:
        model.eval()
        val_loss = sum(nn.functional.mse_loss(model(vx), vy).item() for vx, vy in val)
        model.train()
sys.stdout.write(f"rank {dist.get_rank()} done\n")  # one write: ranks interleave
dist.destroy_process_group()
