"""Codec throughput against the device's copy bandwidth, kernel by kernel, A B A B.

Each round times a plain float32 copy of the gradient (`dst.copy_(src)`: the device's copy
bandwidth, read + write) and then every codec kernel on the same gradient, so each kernel's
ratio is taken against the copy measured beside it. A kernel's bandwidth counts the bytes it
must read and write (the model in `BYTES`), so a memory-bound kernel at the copy's speed
scores 1.0. `x copy time` is the kernel's time over the time to copy the gradient once: what
the codec costs on top of the all-reduce it replaces, in units of the cheapest thing a
kernel can do to the bucket.

On CUDA the int8 and topk codecs run Triton kernels (`kernels/triton_int8.py`,
`kernels/triton_topk.py`) and the torch reference is timed beside them (topk: no bandwidth
model, its selection is not a streaming pass; read `x copy time`); elsewhere only the torch reference runs (Triton's interpreter is a
correctness check, not a speed). Goal (the kernels issue): at least 60% of copy bandwidth.
Timed with CUDA events on a GPU, perf_counter on a CPU; the median of the rounds.
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
from trainspec.kernels import LocalWire  # noqa: E402
from trainspec.kernels.codecs import Bf16Codec, Int8Codec, LowRankCodec, TopKCodec  # noqa: E402
from trainspec.kernels.codecs import int8 as int8_reference  # noqa: E402
from trainspec.kernels.codecs import topk as topk_reference  # noqa: E402
from trainspec.kernels.codecs.int8 import block_count  # noqa: E402

BLOCK = 256
TOPK = 0.01


def bytes_moved(kernel: str, n: int) -> int:
    """Bytes a kernel must read plus write for n float32 gradient values (block 256)."""
    nb = block_count(n, BLOCK)
    model = {
        "copy": 8 * n,  # read 4n, write 4n
        # read grad 4n and residual 4n; write codes n, new residual 4n, scales 4 nb
        "int8 encode": 13 * n + 4 * nb,
        # read out 4n, codes n, scales 4 nb; write out 4n
        "int8 decode+add": 9 * n + 4 * nb,
        # read grad 4n, write bf16 2n; widen the sum: read 2n, write 4n (no error feedback)
        "bf16 codec": 12 * n,
    }
    return model.get(kernel, 0)


class Timer:
    """Seconds per call of `fn`, `inner` calls per timing to hide launch latency."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], inner: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


def kernels(n: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """name -> a call of that kernel on an n-value gradient (inputs made once, here)."""
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(n, generator=gen, device=device)
    residual = torch.randn(n, generator=gen, device=device) * 1e-3
    dst = torch.empty_like(grad)
    codes, scales, _ = int8_reference.quantize_with_feedback(grad, 1.0, residual, BLOCK)
    out = torch.zeros_like(grad)
    wire = LocalWire()
    table: dict[str, Callable[[], Any]] = {
        "copy": lambda: dst.copy_(grad),
        "int8 encode [torch]": lambda: int8_reference.quantize_with_feedback(
            grad, 0.5, residual, BLOCK
        ),
        "int8 decode+add [torch]": lambda: int8_reference.dequantize_accumulate(
            out, codes, scales, BLOCK
        ),
        "bf16 codec": lambda: Bf16Codec().reduce(grad, 0.5, None, 0, wire).wait(),
    }
    if device.type == "cuda":
        from trainspec.kernels import triton_int8

        if triton_int8.available():
            table["int8 encode [triton]"] = lambda: triton_int8.quantize_with_feedback(
                grad, 0.5, residual, BLOCK
            )
            table["int8 decode+add [triton]"] = lambda: triton_int8.dequantize_accumulate(
                out, codes, scales, BLOCK
            )
    k = topk_reference.kept_entries(n, TOPK)
    values, indices, _ = topk_reference.select_with_feedback(grad, 0.5, residual, k)
    from trainspec.kernels import triton_topk

    for backend in ("torch", "triton") if device.type == "cuda" else ("torch",):
        if backend == "triton" and not triton_topk.available():
            continue
        topk = TopKCodec(TOPK, backend=backend)
        table[f"topk:{TOPK} encode [{backend}]"] = lambda topk=topk: topk.select(
            grad, 0.5, residual, k
        )
        table[f"topk:{TOPK} decode+add [{backend}]"] = lambda topk=topk: topk.accumulate(
            out, values, indices
        )
    # The whole codec at world 1: encode, pack scales and codes, decode into a fresh sum.
    codec = Int8Codec(BLOCK)  # auto: Triton on CUDA
    table["int8 codec [auto]"] = lambda: codec.reduce(grad, 0.5, residual, 0, wire).wait()
    # PowerSGD rank 4 on square matrices of 1024 x 1024 (a transformer's projections)
    side = 1024
    if n % (side * side) == 0:
        shapes = [torch.Size([side, side])] * (n // (side * side))
        lowrank = LowRankCodec(4)
        table["lowrank:4 codec"] = lambda: lowrank.reduce(
            grad, 0.5, residual, 0, wire, shapes
        ).wait()
    return table


def measure(n: int, device: torch.device, rounds: int, inner: int) -> list[dict[str, Any]]:
    table = kernels(n, device)
    timer = Timer(device)
    for fn in table.values():  # warm-up: Triton compiles, allocator fills
        timer(fn, 2)
    times: dict[str, list[float]] = {name: [] for name in table}
    ratios: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(rounds):  # A B A B: the copy, then each kernel, every round
        copy_s = timer(table["copy"], inner)
        times["copy"].append(copy_s)
        for name, fn in table.items():
            if name == "copy":
                continue
            t = timer(fn, inner)
            times[name].append(t)
            ratios[name].append(t / copy_s)
    rows = []
    for name in table:
        median_s = statistics.median(times[name])
        moved = bytes_moved(name.split(" [")[0], n)
        # paired: each round's time over the copy timed just before it (A B A B)
        x_copy = statistics.median(ratios[name]) if name != "copy" else 1.0
        rows.append({
            "kernel": name,
            "values": n,
            "median_ms": median_s * 1e3,
            "GB_per_s": moved / median_s / 1e9 if moved else float("nan"),
            "of_copy_bw": moved / bytes_moved("copy", n) / x_copy if moved else float("nan"),
            "x_copy_time": x_copy,
        })  # fmt: skip
    return rows


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args()
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if name not in ("cpu", "cuda"):
        p.error(f"--device {name!r}: use auto, cpu or cuda")
    device = torch.device(name)
    if device.type == "cuda":
        # 2^24 float32 and up: a copy's working set (128 MiB) well past an H100's 50 MB of L2
        sizes = [1 << 25] if args.quick else [1 << 24, 1 << 25, 1 << 27]
        rounds, inner = (5, 5) if args.quick else (9, 10)
    else:
        torch.set_num_threads(1)
        sizes = [1 << 20] if args.quick else [1 << 20, 1 << 22]
        rounds, inner = (3, 2) if args.quick else (5, 3)
    rows = [row for n in sizes for row in measure(n, device, rounds, inner)]
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread"
    print(f"codec throughput on {label} ({rounds} rounds of {inner} calls, medians)")
    print_table(rows)
    write_json(args.json_path, {"device": label, "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
