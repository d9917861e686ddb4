"""One rank of `bench/hook.py`: the reference model under DDP with each gradient hook in
turn, in one two-rank job, alternated A B A B (the order reversed every other round).

Hooks: `builtin` (no hook: DDP's C++ all-reduce), `torch` (torch's Python
`allreduce_hook`), `trainspec` (trainspec's hook at level `none`, the statistics carried in
the last bucket's all-reduce) and `trainspec-separate` (the same with the statistics in an
all-reduce of their own, the design before 2026-11-25). Rank 0 prints one JSON line: per
hook, each round's step times and the training thread's and process's CPU per step.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainspec.kernels.hook import CompressionHook
from trainspec.workload import GPTConfig, TinyGPT

HOOKS = ("builtin", "torch", "trainspec", "trainspec-separate")
WARMUP_STEPS = 10


def wrapped(hook: str, model: torch.nn.Module) -> DistributedDataParallel:
    ddp = DistributedDataParallel(model)
    if hook == "torch":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "trainspec":
        CompressionHook("none").register(ddp)
    elif hook == "trainspec-separate":
        CompressionHook("none", carry_statistics=False).register(ddp)
    return ddp


def one_round(hook: str, model: torch.nn.Module, x: torch.Tensor, steps: int) -> dict[str, Any]:
    ddp = wrapped(hook, model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    times: list[float] = []
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            dist.barrier()
            cpu0, proc0 = time.thread_time(), time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(x, x)[1].backward()
        opt.step()
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    return {
        "step_times": times,
        "thread_cpu_per_step_s": (time.thread_time() - cpu0) / steps,
        "process_cpu_per_step_s": (time.process_time() - proc0) / steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="timed steps per hook per round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=2, n_embd=128)  # the reference workload's model
    model = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size))
    runs: dict[str, list[dict[str, Any]]] = {h: [] for h in HOOKS}
    for r in range(args.rounds):
        for hook in HOOKS if r % 2 == 0 else HOOKS[::-1]:
            runs[hook].append(one_round(hook, model, x, args.steps))
    if dist.get_rank() == 0:
        print(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
