"""The host time of trainspec's per-step pieces on the training thread, each in isolation.

Where the host sets a step's pace (a launch-bound GPU job, a small CPU model) every host
microsecond trainspec spends on the training thread is step time: a 4 ms step has 40 us for
the 1% goal. `bench/overhead.py` measures the whole; this names the parts. Each piece runs
`calls` times per round and rounds alternate piece by piece (A B C A B C), so drift on a
shared machine lands on every piece alike. Beside them, for scale, the torch work a step
does anyway: the optimizer's update of the same model.

On CUDA only the host's time is counted (launches, not kernels): the device is synchronized
between rounds, never inside one, as a step never waits for it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parser, print_table, write_json  # noqa: E402
from trainspec.collector.gradients import (  # noqa: E402
    ClipRecord,
    OptimizerGradientNorm,
    ParameterGradientNorm,
    gradient_norms,
)
from trainspec.host_copy import HostValues  # noqa: E402
from trainspec.runtime.step_timer import CudaPhaseClock, HostPhaseClock, StepTiming  # noqa: E402
from trainspec.workload import GPTConfig, TinyGPT  # noqa: E402

Piece = tuple[Callable[[int], None] | None, Callable[[], Any]]


def pieces(device: torch.device, layers: int, embd: int) -> dict[str, Piece]:
    """Name -> (what prepares a round of n calls, or None; one call of the piece), on a
    TinyGPT of `layers` x `embd` with gradients."""
    model = TinyGPT(GPTConfig(block_size=32, n_layer=layers, n_embd=embd)).to(device)
    x = torch.randint(0, 64, (4, 32), device=device)
    model(x, x)[1].backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    optimizer.step()  # its state exists: later steps are steady-state updates
    clock = CudaPhaseClock(device) if device.type == "cuda" else HostPhaseClock()
    loss = torch.ones((), device=device)
    norm = ParameterGradientNorm(model.parameters())  # one Triton launch on CUDA
    foreach = ParameterGradientNorm(model.parameters(), fused=False)  # torch's path alone

    # The zero-code mode's norm where the script clips (L2): the clip's own result handed
    # over, against each parameter's norm read before the clip (the way before 2026-11-26).
    # The clip itself is the script's work and is in neither.
    params = list(model.parameters())
    zero_code = OptimizerGradientNorm()
    clip_total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))

    def clip_reused() -> None:  # as the zero-code layer does: the clip kept, then handed over
        clips = [ClipRecord(frozenset(id(p) for p in params if p.grad is not None), clip_total)]
        zero_code.capture(optimizer, clips=clips)
        zero_code.step_summary()

    def clip_per_parameter() -> None:
        zero_code.capture(optimizer, before_clip=gradient_norms(params))
        zero_code.step_summary()

    def three_phases() -> StepTiming:
        timing = StepTiming(clock)
        for phase in ("forward", "backward", "optimizer"):
            timing.begin(phase)
            timing.end(phase)
        return timing

    timings: list[StepTiming] = []
    copies: list[HostValues] = []

    def prepare_timings(calls: int) -> None:  # marked before the round, read in it
        timings[:] = [three_phases() for _ in range(calls)]

    def prepare_copies(calls: int) -> None:
        copies[:] = [HostValues(loss) for _ in range(calls)]

    def read_timing() -> None:
        timing = timings.pop()
        timing.ready()
        timing.seconds()

    def read_copy() -> None:
        copy = copies.pop()
        copy.ready()
        copy.floats()

    return {
        "optimizer step (torch, for scale)": (None, optimizer.step),
        "phase mark": (None, clock.mark),
        "three phases marked": (None, three_phases),
        "three phases read": (prepare_timings, read_timing),
        "loss copy to host": (None, lambda: HostValues(loss)),
        "loss read": (prepare_copies, read_copy),
        "gradient norm capture": (None, norm.capture),
        "gradient norm capture, foreach": (None, foreach.capture),
        "gradient norm summary": (None, lambda: (norm.capture(), norm.step_summary())),
        "zero-code clipped norm, clip's result": (None, clip_reused),
        "zero-code clipped norm, per parameter": (None, clip_per_parameter),
    }


def host_seconds(piece: Piece, calls: int, device: torch.device) -> float:
    """Host seconds per call of the piece, prepared and the device caught up before, and
    caught up after."""
    prepare, fn = piece
    if prepare is not None:
        prepare(calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=2, help="TinyGPT layers (default 2)")
    p.add_argument("--embd", type=int, default=128, help="TinyGPT width (default 128)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    if args.layers < 1 or args.embd < 1 or args.embd % 4:
        p.error("--layers must be at least 1 and --embd a positive multiple of 4")
    device = torch.device(args.device)
    rounds, calls = (3, 100) if args.quick else (7, 400)
    work = pieces(device, args.layers, args.embd)
    for piece in work.values():  # warm-up: lazy inits, allocator pools
        host_seconds(piece, 20, device)
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(rounds):
        for name, piece in work.items():
            times[name].append(host_seconds(piece, calls, device))
    update = statistics.median(times["optimizer step (torch, for scale)"])
    rows = []
    for name, seconds in times.items():
        q = sorted(seconds)
        rows.append({
            "piece": name,
            "us_per_call": statistics.median(seconds) * 1e6,
            "us_min": q[0] * 1e6,
            "us_max": q[-1] * 1e6,
            "x_optimizer_step": statistics.median(seconds) / update,
        })  # fmt: skip
    print(f"device {device}, TinyGPT {args.layers} x {args.embd}, {rounds} rounds x {calls} calls")
    print_table(rows)
    write_json(
        args.json_path,
        {"device": str(device), "layers": args.layers, "embd": args.embd, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
