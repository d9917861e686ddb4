"""Two ranks: micro-batches with accumulation under real DDP, an OOM retried on one rank, and
the update still equals the full-batch gradient.

Run under torchrun with TRAINSPEC_INJECT=oom:rank=1,step=1,max_micro=2 (and
TRAINSPEC_ALLOW_INJECT=1). Shares are uneven (11 + 5, through the actuator's rebalance path);
rank 0 runs micro-batches of at most 3 and rank 1 of at most 4, so the ranks run different
numbers of micro-batches. At step 1 rank 1's first micro-batch (3 samples) raises
torch.OutOfMemoryError inside the model's forward (after DDP's pre-forward, which broadcast
the model's buffer); the step is retried at micro-batch 1. Every step's DDP gradient is
compared with a single-process backward over the whole global batch. The model carries a
buffer, so DDP broadcasts buffers at the first forward of each step: a retry that broadcast
again would pair with the other rank's gradient all-reduce and corrupt or hang the job.
Writes {"diffs", "max_abs_grad", "micro", "retries", "redone", "limit"} per rank to argv[1]
({rank}). `GRAD_CHECK_LIMITS=a,b` sets the ranks' micro-batch limits (0: the whole share),
`GRAD_CHECK_BUCKET_MB` DDP's bucket cap,
e.g. with an `oom_backward` fault on a rank that runs its share as one micro-batch: its
backward fails with buckets in flight, the step is voided and run again on every rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import trainspec
from trainspec.actuator.actions import Targets, apply
from trainspec.actuator.findings import Action
from trainspec.data import ShareBatchSampler
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT

SHARES = [11, 5]
LIMITS = [3, 4]
STEPS = 3


class WithBuffer(torch.nn.Module):
    """TinyGPT plus a registered buffer (a loss scale of 1), so DDP broadcasts buffers."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = TinyGPT(cfg)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y)[1] * self.scale


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ts = trainspec.init(process_group_timeout_s=60)
    rank, world = ts.identity.rank, ts.identity.world_size
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    reference = WithBuffer(cfg)
    model = WithBuffer(cfg)
    model.load_state_dict(reference.state_dict())
    cap = os.environ.get("GRAD_CHECK_BUCKET_MB")  # small: several buckets, some sent early
    model = ts.wrap(model, **({"bucket_cap_mb": float(cap)} if cap else {}))
    data = StdlibTextDataset(block_size=32, max_bytes=100_000)
    global_batch = sum(SHARES)
    act = ts.actuate(dataset_len=len(data), global_batch=global_batch, seed=1)
    targets = Targets(rank=rank, global_batch=global_batch, sampler=act.sampler, hook=ts.hook)
    apply(Action("rebalance", "test", after={"shares": SHARES}), targets, step=0)
    limits = [int(v) for v in os.environ.get("GRAD_CHECK_LIMITS", "").split(",") if v] or LIMITS
    act.micro_batch.set_limit(limits[rank])
    everyone = [
        ShareBatchSampler(len(data), global_batch, rank=r, world_size=world, seed=1, shares=SHARES)
        for r in range(world)
    ]

    diffs, micro, max_grad = [], [], 0.0
    for step in range(STEPS):
        batch = act.sampler.next_step()
        x = torch.stack([data[i][0] for i in batch.indices])
        y = torch.stack([data[i][1] for i in batch.indices])
        model.zero_grad(set_to_none=True)
        with ts.step(samples=len(batch.indices)) as s:
            act.use_batch(batch, ts.hook)

            def forward(mb, x=x, y=y):
                return model(x[mb.start : mb.stop], y[mb.start : mb.stop])

            act.accumulate(step, batch, forward, model=model, timer=s)
        micro.append([mb.size for mb in act.runner.last_split])
        ddp_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

        all_idx = [i for sampler in everyone for i in sampler.next_step().indices]
        reference.zero_grad(set_to_none=True)
        xa = torch.stack([data[i][0] for i in all_idx])
        ya = torch.stack([data[i][1] for i in all_idx])
        reference(xa, ya).backward()
        full = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        diffs.append(float((ddp_grad - full).abs().max()))
        max_grad = max(max_grad, float(full.abs().max()))
    record = {
        "diffs": diffs,
        "max_abs_grad": max_grad,
        "micro": micro,
        "retries": act.runner.retries,
        "redone": act.runner.redone,
        "buckets": len(model.reducer._get_zeros_like_grad_buckets()),
        "limit": act.micro_batch.limit,
    }
    ts.close()
    with open(out.replace("{rank}", str(rank)), "w") as fh:
        json.dump(record, fh)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
