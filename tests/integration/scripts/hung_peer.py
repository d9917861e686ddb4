"""Two ranks under DDP with trainspec on; at step 5 rank 1 fails, as `PEER_FAILS` says:

- `stop` (default): it stops itself (SIGSTOP: a frozen node, a partition). Rank 0's DDP step
  fails at the process-group timeout; it then closes trainspec and exits, printing how long
  `ts.close()` took.
- `raise`: its own code raises, and its `finally: ts.close()` runs while the error
  propagates, rank 0 still in the job (blocked in the step's all-reduce). Rank 1 prints how
  long `ts.close()` took and exits with the error.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import trainspec

MODE = os.environ.get("PEER_FAILS", "stop")
ts = trainspec.init(process_group_timeout_s=float(os.environ.get("PG_TIMEOUT_S", "5")))
rank = ts.identity.rank
model_base = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model_base.parameters(), lr=0.01)
model = ts.wrap(model_base, optimizer=opt)


def train() -> None:
    for step in range(40):
        if step == 5 and rank == 1:
            if MODE == "raise":
                raise ValueError("the script's own bug")
            os.kill(os.getpid(), signal.SIGSTOP)
        with ts.step(samples=8):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        time.sleep(0.05)


def close() -> None:
    t0 = time.monotonic()
    ts.close()
    print(f"close took {time.monotonic() - t0:.2f} s", flush=True)


if MODE == "raise":
    try:
        train()
    finally:
        close()
else:
    try:
        train()
    except RuntimeError as exc:  # the training group timed out: the peer is gone
        print(f"training failed: {str(exc)[:80]}", file=sys.stderr, flush=True)
    close()
