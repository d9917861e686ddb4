"""A single-process script that imports nothing of trainspec, run as `trainspec run -- python
single_process.py`: 12 steps of 4 samples from a DataLoader with 2 worker processes whose
dataset applies an nn.Module transform, gradients clipped to a norm of 0.05 (the script prints
each step's norm before clipping), an evaluation under no_grad between reading a batch and
its forward on every third step, about 30 ms a step; then it forks a child that exits."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Normalized(Dataset):
    """Samples through a module, as torchvision's transforms are applied in a loader worker."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.transform = torch.nn.LayerNorm(8, elementwise_affine=False)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(self.data[i])


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held_out = DataLoader(TensorDataset(torch.randn(10, 8)), batch_size=5)
    train = DataLoader(Normalized(torch.randn(48, 8)), batch_size=4, num_workers=2)
    for i, x in enumerate(train):
        if i % 3 == 0:
            with torch.no_grad():
                for (v,) in held_out:
                    model(v)
        model(x).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        sys.stdout.write(f"step {i} norm {float(norm)!r}\n")
        time.sleep(0.03)
        opt.step()
        opt.zero_grad()
    # Forked by the script itself, a child that exits normally must exit 0 and store nothing
    # (closing its inherited session flushed the parent's steps again and crashed).
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    print(f"child status {status} global module hooks {hooks}", flush=True)
    print("done", flush=True)
