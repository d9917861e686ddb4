"""Two ranks under DDP with trainspec on; at step 5 rank 1's own code raises, and its
`finally: ts.close()` runs while the error propagates. Rank 0 is still in the job (blocked
in the step's all-reduce), so a shutdown alignment would wait out its timeout; rank 1
prints how long `ts.close()` took and exits with the error."""

from __future__ import annotations

import os
import time

import torch

import trainspec

ts = trainspec.init(process_group_timeout_s=float(os.environ.get("PG_TIMEOUT_S", "20")))
rank = ts.identity.rank
model_base = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model_base.parameters(), lr=0.01)
model = ts.wrap(model_base, optimizer=opt)
try:
    for step in range(40):
        if step == 5 and rank == 1:
            raise ValueError("the script's own bug")
        with ts.step(samples=8):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
finally:
    t0 = time.monotonic()
    ts.close()
    print(f"close took {time.monotonic() - t0:.2f} s", flush=True)
