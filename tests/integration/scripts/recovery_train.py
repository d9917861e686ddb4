"""TinyGPT under torchrun with the share sampler, the checkpointer, fault injection and heartbeat.

Resumes by itself from the newest committed checkpoint. Writes, per rank and torchrun attempt
(TORCHELASTIC_RESTART_COUNT), `<out>/steps_r<rank>_a<attempt>.jsonl`: a "start" line, a "resume"
line, then one line per trained step with the sample indices it used; `<out>/events_r<rank>_a<
attempt>.jsonl` holds checkpoint and fault events; rank 0 writes `<out>/final.pt` at the end.
"""

from __future__ import annotations

import time

STARTED_UNIX_S = time.time()  # before the heavy imports: restart time is measured from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from trainspec.data import ShareBatchSampler  # noqa: E402
from trainspec.runtime.checkpoint import Checkpointer  # noqa: E402
from trainspec.runtime.heartbeat import Heartbeat, PreemptionWatcher  # noqa: E402
from trainspec.runtime.inject import Injector  # noqa: E402
from trainspec.runtime.process_group import init_default_group  # noqa: E402
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--max-bytes", type=int, default=24_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--shares-at", default="", help="STEP:n0,n1 - change shares before that step")
    p.add_argument("--sync-save", action="store_true")
    p.add_argument(
        "--kill-during-save", default="", help="RANK:STEP - SIGKILL right after starting that save"
    )
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds per step (gives signals time)"
    )
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    return p.parse_args()


class JsonLines:
    def __init__(self, path: Path) -> None:
        self._fh = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def write(self, **record: object) -> None:
        self._fh.write(json.dumps({"t": time.time(), **record}) + "\n")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    steps_log = JsonLines(args.out / f"steps_r{rank}_a{attempt}.jsonl")
    events_log = JsonLines(args.out / f"events_r{rank}_a{attempt}.jsonl")
    steps_log.write(kind="start", started=STARTED_UNIX_S, pid=os.getpid())

    def on_event(kind: str, reason: str, evidence: dict) -> None:
        events_log.write(kind=kind, reason=reason, evidence=evidence)

    injector = Injector.from_env(rank=rank)
    init_default_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(args.seed)
    cfg = GPTConfig(block_size=32, n_layer=args.n_layer, n_head=2, n_embd=args.n_embd)
    dataset = StdlibTextDataset(block_size=cfg.block_size, max_bytes=args.max_bytes)
    model = DDP(TinyGPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    sampler = ShareBatchSampler(
        len(dataset), args.global_batch, rank=rank, world_size=world, seed=args.seed
    )
    ckpt = Checkpointer(
        args.ckpt, keep_last=3, async_save=not args.sync_save, timeout_s=30, on_event=on_event
    )
    heartbeat = Heartbeat(
        interval_s=0.5, timeout_s=5, stall_timeout_s=30, on_event=on_event
    ).start()
    preemption = PreemptionWatcher(timeout_s=30)

    loaded = ckpt.load_latest(
        model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler
    )
    start_step = loaded.step if loaded else 0
    steps_log.write(kind="resume", step=start_step, fallbacks=loaded.fallbacks if loaded else [])
    shares_step, shares = _parse_shares(args.shares_at)
    kill_rank, kill_step = _parse_kill(args.kill_during_save)

    for step in range(start_step + 1, args.steps + 1):
        if injector.faults_at("kill", step):
            steps_log.write(kind="kill", step=step)
        injector.at_step_start(step)
        if step == shares_step:
            sampler.set_shares(shares)
        began = time.perf_counter()
        batch = sampler.next_step()
        loss_sum = _train_step(model, optimizer, dataset, batch, world)
        scheduler.step()
        injector.after_compute(step, time.perf_counter() - began)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        steps_log.write(
            kind="step",
            step=step,
            epoch=batch.epoch,
            indices=batch.indices,
            loss_sum=loss_sum,
            count=batch.global_count,
        )
        heartbeat.progress(step)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
        if preemption.should_stop():
            record = ckpt.save(step, **state, reason="preemption", block=True)
            steps_log.write(kind="preempted", step=step, committed=record is not None)
            heartbeat.stop()
            dist.destroy_process_group()
            return 0
        if step % args.ckpt_every == 0:
            ckpt.save(step, **state, reason="periodic")
            if (rank, step, attempt) == (kill_rank, kill_step, 0):
                steps_log.write(kind="kill", step=step, during_save=True)
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    heartbeat.stop()
    preemption.close()
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            args.out / "final.pt",
        )
    steps_log.write(kind="done", step=args.steps)
    dist.destroy_process_group()
    return 0


def _train_step(model: DDP, optimizer: torch.optim.Optimizer, dataset, batch, world: int) -> float:
    """Sum-of-token loss scaled by W / (N * T), so DDP's mean equals the full-batch gradient
    whatever each rank's share (including an empty one) - DESIGN's uneven-shares rule."""
    t = dataset.block_size
    if batch.indices:
        xs, ys = zip(*(dataset[i] for i in batch.indices), strict=True)
        x, y = torch.stack(xs), torch.stack(ys)
    else:
        x = y = torch.zeros(0, t, dtype=torch.long)
    logits = model(x)
    token_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
    )
    loss = token_loss * world / (batch.global_count * t)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(token_loss.detach())


def _parse_shares(text: str) -> tuple[int, list[int]]:
    if not text:
        return -1, []
    step, shares = text.split(":")
    return int(step), [int(s) for s in shares.split(",")]


def _parse_kill(text: str) -> tuple[int, int]:
    if not text:
        return -1, -1
    rank, step = text.split(":")
    return int(rank), int(step)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        # Exit at once: a dead peer leaves background threads (dcp's uploader) waiting on
        # collectives, and waiting for them would only delay torchrun's restart.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    raise SystemExit(code)
