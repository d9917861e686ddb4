"""The explicit API with no phase blocks: `ts.wrap(model, optimizer=opt)` (or, with the
argument `bare`, `ts.wrap(model)`) and a plain `with ts.step(samples=...)` around each
batch's forward, backward and optimizer step. Its run must still hold every step phase."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import trainspec

ts = trainspec.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
bare = "bare" in sys.argv[1:]
model = ts.wrap(model) if bare else ts.wrap(model, optimizer=opt)
data = torch.utils.data.TensorDataset(torch.randn(480, 8), torch.randn(480, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
loss_fn = torch.nn.MSELoss()
for x, y in loader:
    with ts.step(samples=len(x)):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
print(f"rank {dist.get_rank()} done\n", end="", flush=True)  # one write: ranks share the pipe
ts.close()
dist.destroy_process_group()
