"""Two ranks probe latency with the collector's sampler, rank 1 always launching SKEW_MS
after rank 0 (a sampler thread that wakes late), and every LATE_EVERY-th tick of rank 1 a
further LATE_MS late (a loaded host). Rank 0 prints one JSON line: the median of blocking
one-element all-reduces on the same group (the collective's own round trip), its own
durations (skew plus latency), the readings the sampler reported (latency) and the largest
gaps between their stamps."""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainspec.collector.samplers.latency import LatencyProbeSampler

PROBES, INTERVAL_S = 40, 0.05
skew_s = float(os.environ.get("SKEW_MS", "20")) / 1000.0
late_s = float(os.environ.get("LATE_MS", "0")) / 1000.0
late_every = int(os.environ.get("LATE_EVERY", "0"))
timeout = timedelta(seconds=30)
dist.init_process_group("gloo", timeout=timeout)
probe_group = dist.new_group(backend="gloo", timeout=timeout)
control = dist.new_group(backend="gloo", timeout=timeout)
rank = dist.get_rank()
sampler = LatencyProbeSampler(probe_group, interval_s=INTERVAL_S, timeout_s=10.0)
own: list[float] = []  # this rank's own durations, as the waiter hands them to the ledger
finished = sampler._ledger.finished


def record_own(index, seconds, result):
    if seconds is not None:
        own.append(seconds)
    return finished(index, seconds, result)


sampler._ledger.finished = record_own
round_trips = []
for _ in range(50):
    t0 = time.perf_counter()
    dist.all_reduce(torch.zeros(1), group=probe_group)
    round_trips.append(time.perf_counter() - t0)
dist.barrier()
start = time.monotonic() + 0.1
readings: list[tuple[float, float]] = []
for k in range(PROBES):
    due = start + k * INTERVAL_S
    if rank == 1:
        due += skew_s + (late_s if late_every and k % late_every == late_every - 1 else 0.0)
    time.sleep(max(0.0, due - time.monotonic()))
    readings += [(ts, value) for _, value, _, ts in sampler.sample(time.time())]
aligned = sampler.stop_aligned(control, timeout_s=10.0)
readings += [(ts, value) for _, value, _, ts in sampler.sample(time.time())]
sampler.close()
if rank == 0:
    values = [v for _, v in readings]
    stamps = [ts for ts, _ in readings]
    print(json.dumps({
        "aligned": aligned,
        "readings": len(values),
        "round_trip_median_s": statistics.median(round_trips),
        "in_order": stamps == sorted(stamps) and len(set(stamps)) == len(stamps),
        "reading_median_s": statistics.median(values) if values else None,
        "own_median_s": statistics.median(own) if own else None,
        "gaps_s": sorted((b - a for a, b in zip(stamps, stamps[1:])), reverse=True)[:12],
    }), flush=True)  # fmt: skip
dist.destroy_process_group()
