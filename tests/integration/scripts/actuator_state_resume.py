"""One phase of a two-rank job whose actuator state must survive a restart.

    python -m torch.distributed.run --nproc-per-node=2 actuator_state_resume.py OUT CKPT PHASE

PHASE "first": steps 0-7 of a one-parameter model (so DDP's bucket at a restarted job's first
step is the one the first job had after its rebuild, and updates compare bit for bit) with
the actuator in dry run (`TRAINSPEC_ACTUATOR_DRY_RUN=1`: its controller decides and records,
changes nothing, so only this script moves the plan). Before step 3 the level goes to int8,
each rank's micro-batch limit shrinks as an OOM retry would shrink it (rank 0: OOM at 4,
limit 2; rank 1: OOM at 2, limit 1) and the shares become 5 + 3. After step 5 the actuator's
own checkpointer saves step 6; steps 6 and 7 then run on: the reference.
PHASE "resume": a fresh job on the same directory calls `act.resume()` and runs steps 6, 7.
PHASE "damaged": as "resume", on a checkpoint whose actuator state the test made malformed on
one rank: records the CheckpointError `act.resume()` raises (on every rank) and stops.

Each rank writes OUT/<PHASE>-rank<r>.json: what is in force after the save (first) or the
resume, the step the loop started at, and the weights after steps 6 and 7.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import trainspec
from trainspec.actuator.control_state import controller_state
from trainspec.runtime.checkpoint import CheckpointError

SAVE_AT, STEPS, MOVE_AT = 6, 8, 3


def main() -> None:
    out, ckpt, phase = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ts = trainspec.init(process_group_timeout_s=60)
    rank = ts.identity.rank
    model = torch.nn.Linear(16, 4, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = ts.wrap(model, optimizer=optimizer)
    data = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(64, 16, generator=data), torch.randn(64, 4, generator=data)
    act = ts.actuate(dataset_len=64, global_batch=8, seed=0, checkpoint_dir=ckpt, model=model,
                     optimizer=optimizer, micro_batch=0)  # fmt: skip
    hook = ts.hook
    assert hook is not None and act.controller is not None and act.checkpointer is not None

    def in_force() -> dict[str, Any]:
        return {
            "level": hook.next_level,
            "limit": act.micro_batch.limit,
            "oom_at": act.micro_batch.oom_at,
            "shares": list(act.sampler.shares),
            "controller": controller_state(act.controller),
        }

    report: dict[str, Any] = {"weights": {}}
    if phase == "damaged":
        try:
            act.resume()
        except CheckpointError as exc:
            report["error"] = str(exc)
        act.close()
        ts.close()
        (out / f"{phase}-rank{rank}.json").write_text(json.dumps(report))
        return
    first = act.resume() if phase == "resume" else 0
    report["first_step"] = first
    if phase == "resume":
        report["in_force"] = in_force()
    for step in range(first, STEPS):
        if phase == "first" and step == MOVE_AT:
            hook.set_level("int8", at_step=hook.step)
            act.micro_batch.shrink_after_oom(4 if rank == 0 else 2)
            act.sampler.set_shares([5, 3])
        batch = act.sampler.next_step()
        x, y = xs[batch.indices], ys[batch.indices]
        with ts.step(samples=len(batch.indices)) as s:
            act.use_batch(batch, hook)
            optimizer.zero_grad(set_to_none=True)

            def forward(mb: Any, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.mse_loss(model(x[mb.start : mb.stop]), y[mb.start : mb.stop])

            s.loss = act.accumulate(step, batch, forward, model=model, timer=s)
            optimizer.step()
        if phase == "first" and step + 1 == SAVE_AT:
            act.save_checkpoint(SAVE_AT, "test: the state at step 6")
            act.checkpointer.wait()
            report["in_force"] = in_force()
        if step + 1 > SAVE_AT:
            report["weights"][str(step)] = model.module.weight.detach().tolist()
    act.close()
    ts.close()
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
