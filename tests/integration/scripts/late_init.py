"""Imports trainspec and starts it after making its own process group and DDP model (which
`trainspec run` has then already hooked), then measures 6 steps with its own step() blocks.
TEST_RANK1_LEVEL gives rank 1's config another compression level, TEST_RANK1_NO_CONFIG=1
gives rank 1 no config at all (per-rank mistakes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import trainspec
from trainspec.config import load_config

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
# Under `trainspec run` the session exists already: what of these can apply, does.
level = "bf16"
if dist.get_rank() == 1:
    level = os.environ.get("TEST_RANK1_LEVEL", level)
config = load_config(
    overrides={"kernels": {"compression": level}, "collector": {"peak_flops": 1e12}}
)
if dist.get_rank() == 1 and os.environ.get("TEST_RANK1_NO_CONFIG"):
    config = None
ts = trainspec.init(config=config, flops_per_sample=1e6)
model = ts.wrap(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(6):
    with ts.step(samples=2) as step:
        with step.phase("forward"):
            loss = model(torch.randn(2, 4)).sum()
        with step.phase("backward"):
            loss.backward()
        with step.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        step.loss = loss
print(f"rank {dist.get_rank()} done", flush=True)  # one write: ranks share the pipe
ts.close()
dist.destroy_process_group()
