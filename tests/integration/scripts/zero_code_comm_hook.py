"""DDP with the script's own communication hook, registered right after the model is built
(argv[1]: "fp16", the default; "allreduce"; "builtin", DDP's built-in FP16 hook). Runs under
plain torchrun; zero-code registered trainspec's hook in DDP's `__init__`, and the script's
raised "can only be called once" on every rank (QA, 2026-11-27)."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

kind = sys.argv[1] if len(sys.argv) > 1 else "fp16"
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Linear(32, 1))
if kind == "builtin":
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
else:
    hook = default_hooks.allreduce_hook if kind == "allreduce" else default_hooks.fp16_compress_hook
    model.register_comm_hook(dist.group.WORLD, hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(5):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
sys.stdout.write(f"rank {dist.get_rank()} done\n")  # one write: ranks interleave
dist.destroy_process_group()
