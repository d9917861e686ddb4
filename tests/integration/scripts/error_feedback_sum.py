"""One rank of a job that checks error feedback across steps: parameters held fixed (no
optimizer step) and fixed inputs, so every step's true mean gradient G is the same; after T
steps the applied gradients plus the residuals every rank still holds must sum to T * G.
Rank 0 writes the largest relative error to argv[1]; argv[2] is the level; argv[3] the model.
`three`: its three layers come back from DDP's bucket rebuild after step 0 in another order
inside a bucket, which is what misplaced the residuals. `buckets`: four layers that small
buckets split in several after the rebuild, while step 0 ran them in DDP's one initial
bucket, whose residual then matched no bucket and was dropped."""

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


class Four(torch.nn.Module):
    """Four layers of about 1 KB each: 1 KB buckets split them after DDP's rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for layer in self.layers:
            x = layer(torch.tanh(x))
        return x


MODELS: dict[str, tuple[type[torch.nn.Module], dict[str, float]]] = {
    "three": (Three, {}),
    "buckets": (Four, {"bucket_cap_mb": 1024 / 2**20}),
}


def main() -> None:
    out, level, steps = sys.argv[1], sys.argv[2], 10
    make, ddp_kwargs = MODELS[sys.argv[3] if len(sys.argv) > 3 else "three"]
    ts = trainspec.init(process_group_timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ts.wrap(make(), **ddp_kwargs)
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
    buckets = len(ts.hook._seen)  # the last step's, after DDP's rebuild
    reference = make()
    reference.load_state_dict(model.module.state_dict())
    ((reference(x) - y) ** 2).mean().backward()
    true = [p.grad.clone() for p in reference.parameters()]
    for g in true:
        dist.all_reduce(g)
        g /= world
    # What a checkpoint would keep: kept residuals and pieces not yet taken alike.
    pieces = ts.hook.error_feedback()
    held = []
    for p in params:  # the same order on every rank; zeros where a rank holds no piece
        summed = pieces.get(id(p), torch.zeros(p.numel())).clone()
        dist.all_reduce(summed)
        held.append(summed.view_as(p))
    error = max(
        ((a + h - steps * g).abs().max() / (steps * g).abs().max()).item()
        for a, h, g in zip(applied, held, true)
    )
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"level": ts.hook.level, "error": error, "buckets": buckets}, fh)
    ts.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
