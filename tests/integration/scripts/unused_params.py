"""One rank of a job whose DDP model is built with `find_unused_parameters` (one layer never
used), trained at a multi-round compression level from argv[2]; rank 0 writes what it saw
to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

import trainspec


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def main() -> None:
    out, level = sys.argv[1], sys.argv[2]
    ts = trainspec.init(process_group_timeout_s=60)
    torch.manual_seed(0)
    model = WithUnused()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = ts.wrap(model, optimizer=opt, find_unused_parameters=True)
    ts.hook.set_level(level)
    losses = []
    for _ in range(30):
        x = torch.randn(16, 8)
        with ts.step(samples=16):
            loss = ddp(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss))
    if ts.identity.rank == 0:
        with open(out, "w") as f:
            json.dump({"level": ts.hook.level, "losses": losses}, f)
    ts.close()


if __name__ == "__main__":
    main()
