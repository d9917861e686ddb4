"""One rank of a job whose DDP model is built with `find_unused_parameters` (one layer never
used), trained at a multi-round compression level from argv[2]; rank 0 writes what it saw
to argv[1]. With argv[3] `direct`, no trainspec session: `CompressionHook(level).register`
on DDP's own group, in tiny buckets, as the kernels' contract shows it."""

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


def direct(out: str, level: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from trainspec.kernels import CompressionHook

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = WithUnused()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True, bucket_cap_mb=0.0001
    )
    hook = CompressionHook(level)
    hook.register(ddp)
    losses = []
    for _ in range(30):
        loss = ddp(torch.randn(16, 8))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"level": hook.level, "losses": losses, "own_group": hook.wire.group
                       is not None}, f)  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    out, level = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["direct"]:
        direct(out, level)
        return
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
