"""Two plain processes (no torchrun, so no agent kills the survivor) exercising Heartbeat.

`kill`: rank 1 SIGKILLs itself after a few steps; `stall`: rank 1 stops making progress but
stays alive. Rank 0 writes what its heartbeat reported to `<out>/faults.json` and exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainspec.runtime.heartbeat import Heartbeat


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    faults: list[dict] = []

    def on_event(kind: str, cause: str, evidence: dict) -> None:
        faults.append({"t": time.time(), "kind": kind, "cause": cause, **evidence})

    heartbeat = Heartbeat(
        interval_s=0.2, timeout_s=2.0, stall_timeout_s=1.5, on_event=on_event
    ).start()
    deadline = time.monotonic() + 30
    step = 0
    while time.monotonic() < deadline and not faults:
        step += 1
        if rank == 1 and step == 10:
            if mode == "kill":
                (out / "killed_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            (out / "stalled_at").write_text(str(time.time()))
            time.sleep(15)  # alive, beating, but no progress
            os._exit(0)
        heartbeat.progress(step)
        time.sleep(0.05)
    if rank == 0:
        (out / "faults.json").write_text(json.dumps({"faults": faults, "beats": heartbeat.beats}))
    os._exit(0)  # the heartbeat group is broken after a fault; do not wait on it


if __name__ == "__main__":
    main()
