"""The process group the hook's collectives run on, and a group's timeout.

With `find_unused_parameters` DDP all-reduces its map of used parameters on its own group at
the end of backward, while the multi-round levels (int8, lowrank, topk) launch their later
rounds from future callbacks on a gloo or NCCL thread: on one rank before DDP's collective,
on another after it. Gloo aborted the job ("op.preamble.length <= op.nbytes", 4 of 4 runs at
int8) or both ranks waited out the group's timeout (a QA run of `CompressionHook("int8")`
registered directly on such a model, 2026-11-27). On a group of their own the two orders
cannot cross. It is made only for this case: a communicator costs memory on NCCL.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

FALLBACK_TIMEOUT_S = 300.0  # torch's own default for a gloo group


def group_timeout_s(group: Any, fallback: float) -> float:
    """The timeout `group` was created with; `fallback` where torch does not say (it is read
    through torch's private backend options, so any failure falls back)."""
    try:
        import torch

        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a private API: any change in torch means "unknown"
        return fallback


def needs_own_group(ddp_model: Any, group: Any) -> bool:
    """Whether the hook, about to run on `group` (None: the default group), must have a group
    of its own for `ddp_model`: DDP finds unused parameters on that same group."""
    import torch.distributed as dist

    if not getattr(ddp_model, "find_unused_parameters", False):
        return False
    if not dist.is_initialized():
        return False
    ddp_group = ddp_model.process_group
    if (group if group is not None else dist.group.WORLD) is not ddp_group:
        return False
    return dist.get_world_size(ddp_group) > 1


def own_group(ddp_model: Any) -> Any:
    """A new group over DDP's ranks and backend, with DDP's group's timeout. Collective over
    DDP's ranks: each of them calls it at the same point (the other ranks need not)."""
    import torch.distributed as dist

    group = ddp_model.process_group
    timeout = timedelta(seconds=group_timeout_s(group, FALLBACK_TIMEOUT_S))
    ranks = dist.get_process_group_ranks(group)
    # DDP on a sub-group (pipeline plus data parallelism): only its own ranks get here, each
    # group with other ranks at the same moment, so the new group must not wait on the world.
    local = len(ranks) < dist.get_world_size()
    if local:
        _check_local_names_agree(group)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=timeout,
                          use_local_synchronization=local)  # fmt: skip


def _memberships() -> int:
    """How many process groups this rank is in: torch names a locally synchronised group by
    its ranks and this count (`_hash_ranks_to_str`, a private API: -1 where it changed)."""
    try:
        from torch.distributed import distributed_c10d

        return len(distributed_c10d._world.pg_names)
    except Exception:  # noqa: BLE001 - private: any change in torch means "unknown"
        return -1


def _check_local_names_agree(group: Any) -> None:
    """Raise a one-line RuntimeError where DDP's ranks would name the new group differently:
    a rank in more groups than another (a group of the data-parallel leaders, say) waited
    for its peers under another name until the group's timeout (review, 2026-11-27)."""
    import torch.distributed as dist

    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, _memberships(), group=group)
    if len(set(counts)) != 1 or -1 in counts:
        raise RuntimeError(
            "the compression hook needs a process group of its own next to DDP's "
            "find_unused_parameters, and DDP's ranks are in different numbers of process "
            f"groups ({counts}), so torch cannot make one over DDP's ranks alone: make one "
            "on every rank and pass it, CompressionHook(level, group=...)"
        )
