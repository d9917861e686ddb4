"""The default process group, made safe across torchrun's elastic restarts."""

from __future__ import annotations

import os
from datetime import timedelta


def init_default_group(backend: str, *, timeout: timedelta) -> None:
    """`init_process_group` whose store keys are scoped to this torchrun attempt.

    torchrun shares its rendezvous TCPStore with the workers and does not prefix it per
    restart, so a restarted job would read the dead attempt's gloo addresses ("Connection
    refused" in connectFullMesh, seen with torch 2.13). A per-attempt PrefixStore keeps the
    attempts apart. Outside torchrun's agent store, this is plain `init_process_group`.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"trainspec/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
