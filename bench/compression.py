"""Gradient compression on the reference workload: bytes per step against final loss.

Trains TinyGPT on StdlibTextDataset with 2 gloo ranks from the same seed, the same data and
the same steps under each of our levels (none, bf16, int8, lowrank[-bf16]:R[:W], topk:F) and under torch's
own `fp16_compress_hook` and `powerSGD_hook` (rank R, error feedback, warm start). `LEVEL@K`
runs the first K steps uncompressed, then LEVEL (`LEVEL@K/WARM`: the first K steps at level
WARM); `torch:powersgd:R@K` is torch's `start_powerSGD_iter=K`, so `lowrank:R@K` and it
spend the same bytes. `lowrank:R:W` is our level with W int8 warm-up steps; torch has no
int8 warm-up, so it is compared with `torch:powersgd:R@K` for the K just under and just
over its bytes. `lowrank-bf16:2R:K:exact` spends what `torch:powersgd:R@K` does. Every collective any hook issues is counted by one shim around
torch.distributed.all_reduce / all_gather (ring model, see trainspec/kernels/wire.py), so
all hooks are priced alike; our hook's own count is reported beside it. Each configuration
runs in fresh processes under a timeout (torch's PowerSGD has hung in a gloo recv).
Repetitions alternate A B C .. A B C. `--seed` changes the model's initialisation, where
the data starts, and torch PowerSGD's random seed. `CONFIG+ulp` is CONFIG started from every
weight moved one float32 step up; how far `none+ulp` lands from `none` is the noise floor of
a comparison between final losses (bench/compression_seeds.py takes it over many seeds).
`CONFIG+ulpK` (K >= 1) moves every weight one float32 step up or down, each element's
direction drawn from a generator seeded with K (not with `--seed`): K distinct starting
points a step away. `CONFIG+qK` (after any `+ulp`) starts the hook's own randomness from
seed K: the starting Q of our lowrank levels and of torch's PowerSGD. The replicas of
bench/compression_seeds.py `--replicas` are `CONFIG+ulpK+qK`.

Goals: int8 >= 70% fewer bytes than none, final loss within 1%; lowrank >= 90% fewer,
within 2%; at equal bytes no worse than torch's hook (bf16 vs fp16, lowrank:R@K vs
torch:powersgd:R@K, lowrank:R:W vs torch:powersgd:R@K of about its bytes).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import re
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from trainspec.kernels import CompressionHook  # noqa: E402
from trainspec.kernels.wire import all_gather_sent_bytes, all_reduce_sent_bytes  # noqa: E402
from trainspec.workload import GPTConfig, StdlibTextDataset, TinyGPT  # noqa: E402

WORLD = 2
RANK_R = 4
CONFIGS = [
    "none",
    "bf16",
    "int8",
    f"lowrank:{RANK_R}",
    f"lowrank:{RANK_R}@4",  # 4 uncompressed steps first (after 1-bit Adam's warm-up)
    "torch:fp16",
    # torch refuses its bf16 hook in a build without CUDA and NCCL (whatever the backend):
    # a row saying so here on CPU; on a CUDA build it runs, over gloo as every row does.
    "torch:bf16",
    f"torch:powersgd:{RANK_R}@4",  # start_powerSGD_iter=4: the same bytes as lowrank:4@4
    # The recommended lowrank level: rank 6 after 16 int8 steps, >= 90% saved from 120 steps
    # on; torch's rank 6 starting at step 3 spends a little less, at step 4 a little more.
    "lowrank:6:16",
    "torch:powersgd:6@3",
    "torch:powersgd:6@4",
    # P and Q in bf16: rank 12 for rank 6's bytes per step, one warm-up step fewer so that it
    # spends less than torch's rank 6 from step 3 at 120 and 400 steps; and rank 13 after 3
    # int8 steps, the highest rank under that budget with torch's 3-step start.
    "lowrank-bf16:12:15",
    "lowrank-bf16:13:3",
    # torch's schedule and bytes: 3 exact steps, then rank 12 with bf16 factors (rank 6's
    # bytes), PowerSGD from the seeded Q: torch's schedule.
    "lowrank-bf16:12:3:exact",
]
NUDGE = "+ulp"  # CONFIG+ulp: CONFIG from every weight moved one float32 step up
NUDGED = "none" + NUDGE  # how far it lands from `none` is the noise floor
_NUDGE_SUFFIX = re.compile(r"ulp([1-9][0-9]*)?")
LOSS_TAIL = 20  # final loss = mean global loss of the last LOSS_TAIL steps


def _install_byte_shim(counter: list[int]) -> None:
    """Count every all-reduce / all-gather this process issues from Python, whoever issues
    it. Sums are counted at the process group's own `allreduce`, which `dist.all_reduce`
    calls and our hook's wire calls directly (since ce01a66; a shim on `dist.all_reduce`
    alone saw none of our hook's bytes)."""
    real_reduce, real_gather = dist.ProcessGroup.allreduce, dist.all_gather

    def allreduce(group, tensors, *args, **kwargs):
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            counter[0] += all_reduce_sent_bytes(t.numel() * t.element_size(), WORLD)
        return real_reduce(group, tensors, *args, **kwargs)

    def all_gather(outputs, tensor, *args, **kwargs):
        counter[0] += all_gather_sent_bytes(tensor.numel() * tensor.element_size(), WORLD)
        return real_gather(outputs, tensor, *args, **kwargs)

    dist.ProcessGroup.allreduce, dist.all_gather = allreduce, all_gather


def split_nudge(config: str) -> tuple[str, int | None]:
    """`CONFIG` -> (CONFIG, None); `CONFIG+ulp` -> (CONFIG, 0): every weight one step up;
    `CONFIG+ulpK` -> (CONFIG, K) for K >= 1: up or down, drawn from a generator seeded with
    K. ValueError (one line) for any other suffix after a `+`, K = 0 or leading zeros."""
    base, plus, suffix = config.rpartition("+")
    if not plus:
        return config, None
    match = _NUDGE_SUFFIX.fullmatch(suffix)
    if not base or match is None:
        raise ValueError(
            f"bad configuration {config!r}: the suffix after '+' is ulp (every weight one "
            "float32 step up) or ulpK with an integer K >= 1 (up or down, drawn from seed K)"
        )
    return base, int(match[1]) if match[1] else 0


_Q_SUFFIX = re.compile(r"q([1-9][0-9]{0,3})")


def split_start(config: str) -> tuple[str, int | None, int]:
    """`CONFIG[+ulp|+ulpK][+qK]` -> (CONFIG, the nudge as `split_nudge` reads it, the hook's
    seed K or 0). `+qK` starts the hook's own randomness elsewhere: our lowrank levels' Q
    from `CompressionHook(seed=K)`, torch's PowerSGD from `random_seed = (--seed + 1000003 K) mod 2^32`
    (1 <= K <= 9999). ValueError (one line) for a bad suffix."""
    base, plus, suffix = config.rpartition("+")
    match = _Q_SUFFIX.fullmatch(suffix) if plus else None
    level, nudge = split_nudge(base if match else config)
    if "+" in level or not level:
        raise ValueError(
            f"bad configuration {config!r}: the starts go CONFIG[+ulp|+ulpK][+qK], "
            "K >= 1 (q at most 9999)"
        )
    return level, nudge, int(match[1]) if match else 0


def _nudge_one_ulp(model: torch.nn.Module, signs_seed: int = 0) -> None:
    """Move every weight one float32 step: the smallest change to the starting point. With
    `signs_seed` 0 every weight goes up (`+ulp`); with K >= 1 each element goes up or down
    with probability 1/2, drawn from a generator seeded with K that touches no global RNG
    (`+ulpK`). How far runs from such starts drift apart by the last step is the training
    trajectory's own sensitivity, the noise floor any comparison of final losses has to
    clear."""
    with torch.no_grad():
        if signs_seed == 0:
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
            return
        gen = torch.Generator().manual_seed(signs_seed)
        for p in model.parameters():
            up = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int64).bool()
            toward = torch.where(up, float("inf"), float("-inf")).to(p.dtype)
            p.copy_(torch.nextafter(p, toward))


def _register(
    ddp: DDP, config: str, batch: int, seed: int, q_seed: int = 0
) -> CompressionHook | None:
    if config == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if config == "torch:bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if config.startswith("torch:powersgd:"):
        rank_spec, _, start = config.removeprefix("torch:powersgd:").partition("@")
        state = torch_psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(rank_spec),
            # uncompressed steps first; 2 is the earliest torch allows with error feedback
            start_powerSGD_iter=int(start or 2),
            use_error_feedback=True,
            warm_start=True,
            random_seed=(seed + 1_000_003 * q_seed) % 2**32,  # numpy's RandomState range
        )
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        return None
    # "LEVEL@K": uncompressed for the first K steps, then LEVEL (torch's start_powerSGD_iter);
    # "LEVEL@K/WARM": the first K steps at level WARM instead.
    level, _, after = config.partition("@")
    start, _, warm = after.partition("/")
    first = (warm or "none") if start else level
    hook = CompressionHook(first, local_batch_size=batch, seed=q_seed)
    if start:
        hook.set_level(level, at_step=int(start))
    hook.register(ddp)
    return hook


def _train(
    rank: int, store: str, config: str, steps: int, batch: int, seed: int, out: str, device: str,
    backend: str = "gloo",
) -> None:  # fmt: skip
    # A rank that aborts (SIGABRT) prints every thread's Python stack first: where it was.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",  # no free-port race with other jobs
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    cfg = GPTConfig()
    data = StdlibTextDataset(cfg.block_size, 2_000_000)
    torch.manual_seed(seed)
    # torch's PowerSGD launches its second all-reduce from a continuation; with two buckets
    # the ranks can enqueue collectives in different orders, which gloo aborts on
    # ("Received data size doesn't match expected size"). One bucket avoids that race.
    one_bucket = config.startswith("torch:powersgd")
    level, nudge, q_seed = split_start(config)
    model = TinyGPT(cfg)
    if nudge is not None:
        _nudge_one_ulp(model, nudge)
    # On cuda over gloo every rank shares GPU 0 (gloo copes); NCCL refuses two ranks on one
    # device, so there rank r has GPU r.
    on = torch.device("cpu")
    if device == "cuda":
        on = torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(on)
    model.to(on)
    ddp = DDP(model, bucket_cap_mb=64) if one_bucket else DDP(model)
    hook = _register(ddp, level, batch, seed, q_seed)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    counter = [0]
    _install_byte_shim(counter)
    losses, hook_bytes = [], 0
    start = time.perf_counter()
    for step in range(steps):
        # A seed other than 0 also starts the data elsewhere, so both init and data vary.
        first = (step * WORLD + rank) * batch + seed * 100_003
        xs, ys = zip(*(data[(first + i) % len(data)] for i in range(batch)), strict=True)
        opt.zero_grad(set_to_none=True)
        loss = ddp(torch.stack(xs).to(on), torch.stack(ys).to(on))[1]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if hook is not None:
            hook_bytes += hook.latest_stats().comm_bytes
    wall = time.perf_counter() - start
    shim_bytes = counter[0]
    where = on if backend == "nccl" else torch.device("cpu")  # NCCL gathers device tensors
    gathered = [torch.zeros(steps, dtype=torch.float64, device=where) for _ in range(WORLD)]
    mine = torch.tensor(losses, dtype=torch.float64, device=where)
    dist.all_gather(gathered, mine)  # after counting
    if rank == 0:
        global_loss = torch.stack(gathered).mean(0).tolist()
        record = {
            "config": config,
            "bytes_per_step": shim_bytes / steps,
            "hook_bytes_per_step": hook_bytes / steps if hook is not None else None,
            "final_loss": sum(global_loss[-LOSS_TAIL:]) / LOSS_TAIL,
            "wall_s": wall,
            "losses": global_loss,
        }
        Path(out).write_text(json.dumps(record))
    # Every rank done with its collectives before either tears the group down, and nothing
    # left holding the group for the interpreter's exit to free: a rank aborting with
    # SIGABRT ("terminate called without an active exception") after this function had
    # returned (faulthandler: the main thread with no Python frame, so during interpreter
    # exit) was seen in about 1 of 25-70 runs while DDP, the hook and the futures that
    # reference each other in cycles were only freed then.
    del ddp, hook, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_config(
    config: str, steps: int, batch: int, timeout_s: float, seed: int = 0, device: str = "cpu",
    backend: str = "gloo",
) -> dict:  # fmt: skip
    try:
        split_start(config)
    except ValueError as exc:  # a row saying so, not a traceback in every rank
        return {"config": config, "error": str(exc)}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        ctx = mp.start_processes(
            _train,
            args=(str(Path(tmp) / "store"), config, steps, batch, seed, out, device, backend),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    return {"config": config, "error": f"timed out after {timeout_s:.0f} s"}
        except Exception as exc:  # noqa: BLE001 - a failed configuration is a table row
            return {"config": config, "error": str(exc).strip().splitlines()[-1][:200]}
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return json.loads(Path(out).read_text())


def _summarise(results: list[dict]) -> tuple[list[dict], dict]:
    by_config: dict[str, list[dict]] = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    rows, summary = [], {}
    base = by_config["none"]
    base_bytes = base[0].get("bytes_per_step")
    base_loss = sum(r.get("final_loss", float("nan")) for r in base) / len(base)
    for config, runs in by_config.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append({"config": config, "bytes/step": "-", "saved": "-", "final loss": "-",
                         "vs none": "-", "wall s": "-", "note": runs[0]["error"]})  # fmt: skip
            summary[config] = {"error": runs[0]["error"]}
            continue
        loss = sum(r["final_loss"] for r in ok) / len(ok)
        wall = sum(r["wall_s"] for r in ok) / len(ok)
        nbytes = ok[0]["bytes_per_step"]
        hook_bytes = ok[0]["hook_bytes_per_step"]
        summary[config] = {
            "bytes_per_step": nbytes,
            "hook_bytes_per_step": hook_bytes,
            "bytes_saved": 1 - nbytes / base_bytes,
            "final_loss": loss,
            "loss_vs_none": loss / base_loss - 1,
            "wall_s": wall,
            "repeats": len(ok),
        }
        note = (
            "" if hook_bytes is None or hook_bytes == nbytes else f"hook counted {hook_bytes:.0f}"
        )
        rows.append({
            "config": config,
            "bytes/step": f"{nbytes:,.0f}",
            "saved": f"{100 * (1 - nbytes / base_bytes):.1f}%",
            "final loss": f"{loss:.4f}",
            "vs none": f"{100 * (loss / base_loss - 1):+.2f}%",
            "wall s": f"{wall:.1f}",
            "note": note,
        })  # fmt: skip
    return rows, summary


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="steps per run (quick: 120)")
    p.add_argument("--repeats", type=int, default=None, help="A B .. A B repetitions")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per configuration")
    p.add_argument("--seed", type=int, default=0, help="model init and data offset")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: over gloo, every rank on GPU 0",
    )
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo",
        help=f"nccl: rank r on GPU r (needs --device cuda and {WORLD} GPUs); torch's "
        "bf16_compress_hook is meant for it",
    )  # fmt: skip
    args = p.parse_args()
    steps = args.steps or (120 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 2)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "none" not in configs:
        configs.insert(0, "none")  # the baseline every ratio is taken against
    try:
        for config in configs:
            split_start(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if steps <= LOSS_TAIL or repeats < 1 or args.batch_size < 1:
        print(
            f"error: need --steps > {LOSS_TAIL}, --repeats >= 1, --batch-size >= 1", file=sys.stderr
        )
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.backend == "nccl" and args.device != "cuda":
        print("error: --backend nccl needs --device cuda", file=sys.stderr)
        return 2
    if args.backend == "nccl" and torch.cuda.device_count() < WORLD:
        print(
            f"error: --backend nccl needs {WORLD} GPUs (one per rank), torch sees "
            f"{torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    for _ in range(repeats):
        for config in configs:
            results.append(
                run_config(
                    config,
                    steps,
                    args.batch_size,
                    args.timeout_s,
                    args.seed,
                    args.device,
                    args.backend,
                )  # fmt: skip
            )
            r = results[-1]
            done = r.get("error") or f"loss {r['final_loss']:.4f} in {r['wall_s']:.1f} s"
            print(f"  {config}: {done}", flush=True)
    rows, summary = _summarise(results)
    print(
        f"\n{WORLD} {args.backend} ranks on {args.device}, TinyGPT {GPTConfig()}, {steps} steps, "
        f"batch {args.batch_size}/rank, seed {args.seed}"
    )
    print_table(rows)
    write_json(args.json_path, {
        "world_size": WORLD, "device": args.device, "backend": args.backend, "steps": steps, "seed": args.seed, "repeats": repeats, "batch_per_rank": args.batch_size,
        "summary": summary, "runs": results,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
