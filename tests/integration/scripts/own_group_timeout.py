"""The script makes its own default group with a 7 s timeout, then starts trainspec with no
timeout argument: rank 0 prints the side groups' timeouts in seconds."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import trainspec

dist.init_process_group("gloo", timeout=timedelta(seconds=7))
ts = trainspec.init()
if dist.get_rank() == 0:
    for name in ("probe", "control"):
        group = getattr(ts.groups, name)
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        print(f"{name} timeout {timeout.total_seconds():g}", flush=True)
ts.close()
dist.destroy_process_group()
