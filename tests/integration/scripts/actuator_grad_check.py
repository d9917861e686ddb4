"""Two ranks: after the actuator's rebalance action, the DDP update equals the full-batch gradient.

Run under torchrun. Each rank builds the session (collector and gradient hook on), applies a
rebalance `Action` through `trainspec.actuator.actions.apply` (the controller's own path: the
share sampler and the hook's n_r / N weight), runs one DDP backward on its share, and compares
the averaged gradient with a single-process backward over the whole global batch.
Writes {"max_abs_diff", "max_abs_grad", "shares", "indices"} per rank to argv[1] (with {rank}).
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


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ts = trainspec.init()
    rank, world = ts.identity.rank, ts.identity.world_size
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    reference = TinyGPT(cfg)
    model = TinyGPT(cfg)
    model.load_state_dict(reference.state_dict())
    model = ts.wrap(model)
    data = StdlibTextDataset(block_size=32, max_bytes=100_000)
    global_batch = sum(SHARES)
    act = ts.actuate(dataset_len=len(data), global_batch=global_batch, seed=1)
    targets = Targets(rank=rank, global_batch=global_batch, sampler=act.sampler, hook=ts.hook)
    apply(Action("rebalance", "test", after={"shares": SHARES}), targets, step=0)

    batch = act.sampler.next_step()
    x = torch.stack([data[i][0] for i in batch.indices])
    y = torch.stack([data[i][1] for i in batch.indices])
    with ts.step(samples=len(batch.indices)):
        _, loss = model(x, y)
        loss.backward()
    ddp_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    everyone = [ShareBatchSampler(len(data), global_batch, rank=r, world_size=world, seed=1,
                                  shares=SHARES).next_step().indices for r in range(world)]  # fmt: skip
    all_idx = [i for part in everyone for i in part]
    xa = torch.stack([data[i][0] for i in all_idx])
    ya = torch.stack([data[i][1] for i in all_idx])
    reference(xa, ya)[1].backward()
    full = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    record = {
        "max_abs_diff": float((ddp_grad - full).abs().max()),
        "max_abs_grad": float(full.abs().max()),
        "shares": list(batch.shares),
        "indices": batch.indices,
    }
    ts.close()
    with open(out.replace("{rank}", str(rank)), "w") as fh:
        json.dump(record, fh)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
