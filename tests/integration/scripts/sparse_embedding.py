"""One rank of a job whose model has a sparse-gradient embedding; rank 0 writes what it saw
to argv[1]. The hook raised on the sparse bucket in backward and ended the job."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import trainspec


def main() -> None:
    ts = trainspec.init(process_group_timeout_s=60)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(40, 1)
    )
    model = ts.wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        with ts.step(samples=4):
            opt.zero_grad()
            loss = model(torch.randint(0, 50, (4, 5))).pow(2).mean()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump({"hook": ts.hook is not None, "losses": losses}, fh)
    ts.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
