"""One rank of a 4-rank job with two data-parallel groups, {0, 1} and {2, 3}, as in pipeline
plus data parallelism: each group trains its own model under DDP on that group, with
`CompressionHook(level).register(ddp)` by hand and no group given to the hook. Every step
each rank checks DDP's gradient against the mean of its group's local gradients, computed
by a plain copy of the model and an explicit all-reduce on the group. Rank 0 and rank 2
write what they saw to argv[1] + ".rankN.json". argv[2]: the level; argv[3:]: `unused` to
build DDP with `find_unused_parameters` (one layer never used), `leaders` to put ranks 0 and 2
in one more group (of the groups' leaders) than ranks 1 and 3."""

from __future__ import annotations

import copy
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from unused_params import WithUnused  # the script's own directory is on sys.path

from trainspec.kernels import CompressionHook


def main() -> None:
    out, level = sys.argv[1], sys.argv[2]
    unused = "unused" in sys.argv[3:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    # every rank makes every group, in the same order (what `dist.new_subgroups` does)
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=20)),
              dist.new_group([2, 3], timeout=timedelta(seconds=20))]  # fmt: skip
    mine = groups[rank // 2]
    if "leaders" in sys.argv[3:]:  # ranks 0 and 2 in one more group than ranks 1 and 3
        dist.new_group([0, 2], timeout=timedelta(seconds=20))
    torch.manual_seed(100 + rank // 2)  # one model per group, different between groups
    model = WithUnused()
    if not unused:
        model.unused.requires_grad_(False)  # DDP leaves it out: every parameter is used
    plain = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, process_group=mine, find_unused_parameters=unused, bucket_cap_mb=0.0001
    )
    hook = CompressionHook(level)
    try:
        hook.register(ddp)
    except RuntimeError as exc:  # every rank of the group refuses alike, at once
        if rank in (0, 2):
            with open(f"{out}.rank{rank}.json", "w") as f:
                json.dump({"error": str(exc)}, f)
        return
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(12):
        x = torch.randn(16, 8, generator=gen)
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        plain(x).backward()
        ddp(x).backward()
        for p_ddp, p_ref in zip(model.parameters(), plain.parameters(), strict=True):
            if p_ref.grad is None:  # the unused layer
                continue
            want = p_ref.grad.clone()
            dist.all_reduce(want, group=mine)
            want /= 2
            worst = max(worst, float((p_ddp.grad - want).abs().max()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
        model.zero_grad()
    if rank in (0, 2):
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"level": hook.level, "worst_abs_diff": worst,
                       "hook_world": hook.wire.world_size,
                       "own_group": hook.wire.group is not mine}, f)  # fmt: skip
    # no destroy_process_group: the groups go at exit, the hook's last (kernels/teardown.py);
    # destroyed here first, one rank once aborted at exit ("Resource deadlock avoided")


if __name__ == "__main__":
    main()
