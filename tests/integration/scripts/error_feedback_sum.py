"""One rank of a job that checks error feedback across steps: parameters held fixed (no
optimizer step) and fixed inputs, so every step's true mean gradient G is the same; after T
steps the applied gradients plus the residuals every rank still holds must sum to T * G.
Rank 0 writes the largest relative error to argv[1]; argv[2] is the level. The model's
three layers come back from DDP's bucket rebuild after step 0 in another order inside a
bucket, which is what misplaced the residuals."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import trainspec


class Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16, bias=False)
        self.b = torch.nn.Linear(16, 8, bias=False)
        self.c = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def main() -> None:
    out, level, steps = sys.argv[1], sys.argv[2], 10
    ts = trainspec.init(process_group_timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ts.wrap(Three())
    ts.hook.set_level(level)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(32, 16, generator=torch.Generator().manual_seed(100 + rank))
    params = list(model.module.parameters())
    applied = [torch.zeros_like(p) for p in params]
    for _ in range(steps):
        with ts.step(samples=32):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
        for a, p in zip(applied, params):
            a += p.grad
    reference = Three()
    reference.load_state_dict(model.module.state_dict())
    ((reference(x) - y) ** 2).mean().backward()
    true = [p.grad.clone() for p in reference.parameters()]
    for g in true:
        dist.all_reduce(g)
        g /= world
    by_id = {id(p): p for p in params}
    held = {id(p): torch.zeros_like(p) for p in params}
    for key in sorted(ts.hook._residuals):  # the same keys on every rank
        layout, residual = ts.hook._residuals[key]
        summed = residual.clone()
        dist.all_reduce(summed)
        for (pid, _n), piece in zip(layout, summed.split([n for _, n in layout])):
            held[pid] += piece.view_as(by_id[pid])
    error = max(
        ((a + held[id(p)] - steps * g).abs().max() / (steps * g).abs().max()).item()
        for a, p, g in zip(applied, params, true)
    )
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"level": ts.hook.level, "error": error}, fh)
    ts.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
