"""A single-process script that imports nothing of trainspec, run as `trainspec run -- python
single_process.py`: 12 steps of 4 samples from a DataLoader, an evaluation under no_grad
between reading a batch and its forward on every third step, about 30 ms a step."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
held_out = DataLoader(TensorDataset(torch.randn(10, 8)), batch_size=5)
for i, (x,) in enumerate(DataLoader(TensorDataset(torch.randn(48, 8)), batch_size=4)):
    if i % 3 == 0:
        with torch.no_grad():
            for (v,) in held_out:
                model(v)
    model(x).sum().backward()
    time.sleep(0.03)
    opt.step()
    opt.zero_grad()
print("done", flush=True)
