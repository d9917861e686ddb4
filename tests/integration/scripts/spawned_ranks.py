"""A plain DDP script (nothing of ours imported) that starts its own ranks, as many do
without torchrun: `torch.multiprocessing.spawn`, `start_processes(start_method="fork")`, or
a forkserver `multiprocessing.Process`. Each rank passes rank and world size to
`init_process_group` itself; no RANK or WORLD_SIZE is in the environment.

usage: spawned_ranks.py PORT {spawn,fork,forkserver} [--no-destroy]
"""

import multiprocessing
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

WORLD = 2
STEPS = 12


def train(rank: int, port: str, destroy: bool) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(STEPS * 4, 16), torch.randn(STEPS * 4, 1))
    # a forked loader worker: never a rank, though it inherits the rank's patched torch
    for x, y in DataLoader(data, batch_size=4, num_workers=1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print(f"rank {rank} trained {STEPS} env RANK {os.environ.get('RANK')}\n", end="", flush=True)
    if destroy:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    port, method = sys.argv[1], sys.argv[2]
    destroy = "--no-destroy" not in sys.argv
    if method == "spawn":
        mp.spawn(train, args=(port, destroy), nprocs=WORLD)
        return
    if method == "fork":
        mp.start_processes(train, args=(port, destroy), nprocs=WORLD, start_method="fork")
        return
    ctx = multiprocessing.get_context(method)
    workers = [ctx.Process(target=train, args=(r, port, destroy)) for r in range(WORLD)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sys.exit(max(w.exitcode for w in workers))


if __name__ == "__main__":
    main()
