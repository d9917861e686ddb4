"""Two ranks save three checkpoints; at the second, rank 1 cannot prepare its part.

    python -m torch.distributed.run --nproc-per-node=2 checkpoint_vote.py OUT_DIR async|sync

Each rank writes OUT_DIR/rank-R.json: per save, whether a record came back, the events it
emitted, and the seconds the call took; then what `load_latest` restored.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainspec.runtime.checkpoint import Checkpointer

TIMEOUT_S = 60.0  # a rank waiting out a collective would take this long


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events: list[dict] = []
    ck = Checkpointer(
        out / "ckpt",
        async_save=mode == "async",
        timeout_s=TIMEOUT_S,
        on_event=lambda kind, reason, ev: events.append({"reason": reason, **ev}),
    )
    saves = []
    for step in (1, 2, 3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        # Step 2: rank 1's own state is not JSON, so it cannot prepare its part.
        state = {"step": step, "bad": object()} if step == 2 and rank == 1 else {"step": step}
        before = len(events)
        t0 = time.perf_counter()
        record = ck.save(step, model=model, optimizer=opt, trainspec_state=state, block=True)
        saves.append({
            "step": step, "record": record is not None, "seconds": time.perf_counter() - t0,
            "reasons": [e["reason"] for e in events[before:]],
        })  # fmt: skip
    loaded = ck.load_latest(model=model, optimizer=opt)
    ck.close()
    report = {"saves": saves, "loaded_step": loaded.step if loaded else None}
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
