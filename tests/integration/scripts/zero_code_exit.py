"""A plain DDP script (nothing of ours imported) that ends in one of several ways (argv[1]):
"exit1": `sys.exit(1)` at step 3, after its backward, before its optimizer step; "exit0":
`sys.exit(0)` after the last of 6 steps, its process group left standing; "caught":
`sys.exit(1)` at step 3 caught by the script, which trains on to the end; "hook": the script
replaces `sys.excepthook` first thing, and raises RuntimeError("boom") at step 3; "osexit3":
`os._exit(3)` at step 3, after its backward (no atexit handler runs)."""

import os
import sys

if sys.argv[1] == "hook":

    def their_hook(kind, exc, tb):
        sys.stderr.write(f"their hook: {kind.__name__}: {exc}\n")

    sys.excepthook = their_hook  # over trainspec's, installed at start-up

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS, AT = 6, 3


def give_up(mode: str) -> None:
    """What the script does at step AT, after its backward."""
    if mode == "exit1":
        sys.exit(1)
    if mode == "osexit3":
        os._exit(3)
    if mode == "hook":
        raise RuntimeError("boom")
    if mode == "caught":
        try:
            sys.exit(1)
        except SystemExit as exc:
            sys.stdout.write(f"caught exit {exc.code}\n")


def main(mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))
        loss.backward()
        if step == AT:
            give_up(mode)
        opt.step()
    sys.stdout.write(f"rank {dist.get_rank()} done\n")  # one write: ranks interleave
    if mode == "exit0":
        sys.exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
