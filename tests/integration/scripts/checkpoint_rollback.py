"""One phase of a two-rank job that is restarted in the middle of a loss spike.

    python -m torch.distributed.run --nproc-per-node=2 checkpoint_rollback.py OUT CKPT PHASE

A linear model learns targets it cannot predict, so its loss stays near 1 window after window
(64 samples a step: a window's mean moves a few percent). From step SPIKE_AT on, the loss
each rank reports is FACTOR x the real one: a spike that lasts, as a learning rate gone wrong
gives. The actuator's checkpoint policy saves through `actuate()`'s own Checkpointer (the test
sets `keep_last` 1 and an MTBF so short that every window is due a periodic save).
PHASE "first": steps 0 to STOP - 1, then stops in the middle of the spike.
PHASE "resume": a fresh job on the same directory calls `act.resume()` and runs to END, the
spike still on.

Each rank writes OUT/<PHASE>-rank<r>.json: the step its loop started at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import trainspec

SPIKE_AT, FACTOR, STOP, END = 10, 10.0, 18, 26
GLOBAL_BATCH, SAMPLES = 64, 64 * END


def main() -> None:
    out, ckpt, phase = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ts = trainspec.init(process_group_timeout_s=60)
    rank = ts.identity.rank
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = ts.wrap(model, optimizer=optimizer)
    data = torch.Generator().manual_seed(1)
    xs = torch.randn(SAMPLES, 16, generator=data)
    ys = torch.randn(SAMPLES, 4, generator=data)
    act = ts.actuate(dataset_len=SAMPLES, global_batch=GLOBAL_BATCH, seed=0,
                     checkpoint_dir=ckpt, model=model, optimizer=optimizer)  # fmt: skip
    assert act.controller is not None and act.checkpointer is not None
    first = act.resume() if phase == "resume" else 0
    for step in range(first, STOP if phase == "first" else END):
        batch = act.sampler.next_step()
        x, y = xs[batch.indices], ys[batch.indices]
        with ts.step(samples=len(batch.indices)) as s:
            act.use_batch(batch, ts.hook)
            optimizer.zero_grad(set_to_none=True)

            def forward(mb: Any, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.mse_loss(model(x[mb.start : mb.stop]), y[mb.start : mb.stop])

            loss = act.accumulate(step, batch, forward, model=model, timer=s)
            s.loss = loss * (FACTOR if step >= SPIKE_AT else 1.0)
            optimizer.step()
    act.close()
    ts.close()
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps({"first_step": first}))


if __name__ == "__main__":
    main()
