"""Train the reference TinyGPT with trainspec: the complete, explicit integration example.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 100

Runs on CPU with gloo or on CUDA with NCCL (one GPU per rank). Everything trainspec does is
in the lines marked `trainspec:`. Each step draws a constant global batch from one seeded
permutation, split into per-rank shares that the actuator may rebalance toward the faster
ranks. Each rank's share runs as micro-batches with gradient accumulation (`act.accumulate`:
the whole share at once unless `--micro-batch` or `actuator.micro_batch` says otherwise; the
actuator shrinks it under memory pressure and an out-of-memory step is retried smaller).
Faults staged with TRAINSPEC_INJECT (needs TRAINSPEC_ALLOW_INJECT=1) are applied: `slow`
(this rank's compute takes `factor` x as long), `spike` (the reported loss at that step is
multiplied by `factor`, default 10: what a loss detector sees; the update is not harmed),
`squeeze` (the memory probe reports pressure), `oom` (a forward over too large a micro-batch
raises torch.OutOfMemoryError), `kill` and `preempt`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import trainspec
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT
from trainspec.workload.device_time import SimulatedDevice

# A backward pass costs about twice its forward (Kaplan et al., 2020, "Scaling laws", sec. 2.1),
# so an injected slowdown timed on the forward scales to the whole step's compute.
FORWARD_TO_STEP = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--global-batch", type=int, default=0, help="default: batch-size x ranks")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="samples per micro-batch (0: the whole share); default: actuator.micro_batch",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes to load")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--run-root", default=None, help="runs root (default: config store.root)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints the actuator decides go here")
    p.add_argument(
        "--simulate-device-ms",
        default=None,
        metavar="FIXED,PER_SAMPLE",
        help="benchmarks only: each forward also waits FIXED + PER_SAMPLE x samples ms and "
        "its backward twice that, as a host waits on a GPU (trainspec/workload/device_time.py)",
    )
    p.add_argument("--timings", default=None, help="rank 0 writes its step times here (JSON)")
    p.add_argument(
        "--actuator-log",
        default=None,
        help="each rank writes its shares, sample indices and the actuator's decisions here "
        "(JSON; {rank} in the name is replaced by the rank)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "layers", "embd"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        args.simulated = (
            SimulatedDevice.parse(args.simulate_device_ms) if args.simulate_device_ms else None
        )
    except ValueError as exc:
        p.error(str(exc))
    return args


def collate(dataset: StdlibTextDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [dataset[i] for i in (indices or [0])]  # an empty share still runs (weight 0)
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores

    cfg = GPTConfig(block_size=args.block_size, n_layer=args.layers, n_embd=args.embd)
    try:
        ts = trainspec.init(  # trainspec: collector, side groups, run store
            run_root=args.run_root,
            device=device,
            flops_per_sample=cfg.flops_per_token() * args.block_size,
        )
    except ValueError as exc:  # a bad setting (trainspec's ConfigError): one line, exit 2
        print(f"train_gpt.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    model = TinyGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model = ts.wrap(model, optimizer=optimizer)  # trainspec: DDP + gradient hook

    dataset = StdlibTextDataset(block_size=args.block_size, max_bytes=args.max_bytes)
    world, rank = ts.identity.world_size, ts.identity.rank
    global_batch = args.global_batch or args.batch_size * world
    try:
        act = ts.actuate(  # trainspec: share sampler, fault injection, the closed loop
            dataset_len=len(dataset),
            global_batch=global_batch,
            seed=args.seed,
            device=device,
            checkpoint_dir=args.ckpt_dir,  # actuator-decided checkpoints (Young/Daly, anomalies)
            model=model,
            optimizer=optimizer,
            micro_batch=args.micro_batch,  # gradient accumulation; the memory action moves it
        )
    except ValueError as exc:  # a bad setting (TRAINSPEC_INJECT, micro-batch): one line, exit 2
        print(f"train_gpt.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    # trainspec: a restarted attempt (torchrun --max-restarts) continues from the newest
    # committed checkpoint: model, optimizer and the sampler's position; 0 on a fresh start.
    try:
        first_step = act.resume()
    except trainspec.CheckpointError as exc:  # another world size's, or none that loads
        print(f"train_gpt.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    def batches() -> Iterator[tuple[Any, torch.Tensor, torch.Tensor]]:
        while True:
            batch = act.sampler.next_step()
            yield (batch, *collate(dataset, batch.indices))

    log: dict[str, list] = {"shares": [], "indices": [], "levels": [], "steps": [], "micro": []}
    step_times: list[float] = []
    started, cpu_started, threads_started = time.perf_counter(), time.process_time(), _thread_cpu()
    data = ts.iter_data(batches())  # trainspec: data wait
    for step in range(first_step, args.steps):
        if act.should_stop(step):  # trainspec: preemption notice -> checkpoint, then stop
            break
        act.injector.at_step_start(step)
        batch, x, y = next(data)
        t_step = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ts.step(samples=len(batch.indices), tokens=len(batch.indices) * x.shape[1]) as s:
            act.use_batch(batch, ts.hook)  # trainspec: this step's shares to the gradient hook
            optimizer.zero_grad(set_to_none=True)
            forward = _micro_forward(model, x, y, act.injector, step, args.simulated)
            # trainspec: micro-batches with accumulation (no_sync on all but the last), timed
            # as forward/backward phases; an out-of-memory micro-batch is retried smaller
            loss = act.accumulate(step, batch, forward, model=model, timer=s)
            with s.phase("optimizer"):
                optimizer.step()
            # an empty share (weight 0: an epoch's remainder, a rank rebalanced to nothing)
            # has no loss of its own: report none rather than its placeholder's 0
            s.loss = loss * _spike(act.injector, step) if batch.indices else None
        step_times.append(time.perf_counter() - t_step)
        log["shares"].append(list(batch.shares))
        log["indices"].append(batch.indices)
        log["levels"].append(ts.hook.level if ts.hook is not None else None)
        log["micro"].append([mb.size for mb in act.runner.last_split] if act.runner else [])
        log["steps"].append(step_times[-1])
    wall, process_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    collector_cpu = ts.collector.cpu_seconds() if ts.collector is not None else 0.0
    thread_cpu = {k: v - threads_started.get(k, 0.0) for k, v in _thread_cpu().items()}
    thread_settings = _thread_settings()  # before close: trainspec's threads still run
    act.close()  # trainspec: waits for an in-flight checkpoint
    ts.close()  # trainspec: flush, every rank in step
    if args.timings and rank == 0:
        record = {
            "step_times": step_times,
            "wall_s": wall,
            "collector_cpu_s": collector_cpu,
            "process_cpu_s": process_cpu,  # every thread of this rank, training included
            "threads": thread_settings,
            "thread_cpu_s": thread_cpu,  # over the training loop only
        }
        Path(args.timings).write_text(json.dumps(record))
    if args.actuator_log:
        _write_actuator_log(Path(args.actuator_log.replace("{rank}", str(rank))), act, log)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _thread_settings() -> dict[str, int]:
    """What the benchmarks compare between modes: torch's pools and the OS threads alive."""
    tasks = Path("/proc/self/task")
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        "os_threads": len(list(tasks.iterdir())) if tasks.is_dir() else -1,
    }


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name (Python's names where known, else the OS's): where a
    rank's CPU goes besides the training thread. Empty where psutil cannot list threads."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        threads = psutil.Process().threads()
    except (psutil.Error, NotImplementedError):
        return out
    for t in threads:
        name = names.get(t.id)
        if name is None:
            try:  # a thread may end between the listing and this read (a CI run's rank died)
                name = Path(f"/proc/self/task/{t.id}/comm").read_text().strip()
            except OSError:
                name = "native"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def _micro_forward(
    model: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    injector: Any,
    step: int,
    simulated: SimulatedDevice | None = None,
) -> Callable[[Any], torch.Tensor]:
    """The mean loss over one micro-batch's positions of the share."""

    def forward(mb: Any) -> torch.Tensor:
        t_fwd = time.perf_counter()
        _, loss = model(x[mb.start : mb.stop], y[mb.start : mb.stop])
        if simulated is not None:
            simulated.wait_forward(mb.stop - mb.start)
        injector.after_compute(step, FORWARD_TO_STEP * (time.perf_counter() - t_fwd))
        if simulated is not None:  # the backward's device time (device_time.py: why here)
            simulated.wait_backward(mb.stop - mb.start)
        return loss

    return forward


def _spike(injector: Any, step: int) -> float:
    faults = injector.faults_at("spike", step)
    return max((f.factor or 10.0 for f in faults if f.step is not None), default=1.0)


def _write_actuator_log(path: Path, act: Any, log: dict[str, list]) -> None:
    ctl = act.controller
    record = {
        **log,
        "enabled": ctl is not None,
        "history": ctl.history if ctl is not None else [],
        "cost": {**asdict(ctl.cost), "per_step_s": ctl.cost.per_step_s} if ctl else None,
        "stopped": ctl.stopped if ctl is not None else None,
        "global_batch": act.sampler.global_batch,
        "dataset_len": act.sampler.dataset_len,
    }
    path.write_text(json.dumps(record, default=str))


if __name__ == "__main__":
    sys.exit(main())
