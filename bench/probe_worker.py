"""One rank of `bench/probe.py`: compute (optionally in lockstep with the other ranks) for a
fixed time while a side thread probes latency the way the collector does, or not at all.

Modes: `none` (no probe thread), `wake` (a thread that only wakes every interval), `one`
(one all-reduce per interval on a side gloo group, of the collector's payload: MAX over LAGS
doubles, one since 2026-11-25), `wide` (the same over 40 doubles, the payload from the fifth
series of 2026-11-24 to 2026-11-25) and `two` (two one-element all-reduces per interval, the
collector's probe before that). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainspec.collector.samplers.latency import LAGS

MODES = ("none", "wake", "one", "wide", "two")
WIDE_PAYLOAD = 40  # doubles: the probe's payload until 2026-11-25


def probe_loop(mode: str, group: dist.ProcessGroup, interval_s: float, probes: int,
               count: list[int]) -> None:  # fmt: skip
    """`probes` probes, the same number on every rank, so none is left without a partner."""
    for _ in range(probes):
        if mode == "two":
            first = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
            second = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
            first.wait()
            second.wait()
        elif mode in ("one", "wide"):
            payload = torch.zeros(LAGS if mode == "one" else WIDE_PAYLOAD, dtype=torch.float64)
            dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        count[0] += 1
        time.sleep(interval_s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--lockstep", action="store_true", help="all-reduce 1 M floats per round")
    p.add_argument("--rounds", type=int, default=240, help="the same on every rank (lockstep)")
    p.add_argument("--interval-s", type=float, default=0.05)
    args = p.parse_args()
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    side = dist.new_group(backend="gloo", timeout=timeout)
    dist.all_reduce(torch.zeros(1), group=side)  # connected before timing starts
    count = [0]
    probes = round(args.rounds / 30 / args.interval_s)  # about the loop's length (30 rounds/s)
    thread = threading.Thread(
        target=probe_loop, args=(args.mode, side, args.interval_s, probes, count), daemon=True
    )
    x, grad = torch.randn(256, 256), torch.randn(1_000_000)
    dist.barrier()
    if args.mode != "none":
        thread.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.rounds):
        for _ in range(60):
            x = torch.tanh(x @ x * 0.01)
        if args.lockstep:
            dist.all_reduce(grad)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if args.mode != "none":
        thread.join()
    probe_wall = time.perf_counter() - t0
    dist.barrier(group=side)
    if dist.get_rank() == 0:
        print(json.dumps({"rounds_per_s": args.rounds / wall, "probes_per_s": count[0] / probe_wall,
                          "process_cpu_per_s": cpu / wall}), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
