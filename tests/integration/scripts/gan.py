"""A GAN's loop, importing nothing of trainspec: two DDP models, two optimizers, one
DataLoader batch per training step, and G's forward between D's step and G's. 12 batches of
8 samples per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
G = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
)
D = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
)
opt_g = torch.optim.Adam(G.parameters(), 1e-3)
opt_d = torch.optim.Adam(D.parameters(), 1e-3)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(96, 4)), batch_size=8
)
bce = torch.nn.BCEWithLogitsLoss()
for (real,) in loader:
    fake = G(torch.randn(8, 8))
    opt_d.zero_grad()
    loss_d = bce(D(real), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(D(fake), torch.ones(8, 1)).backward()
    opt_g.step()
dist.barrier()
dist.destroy_process_group()
