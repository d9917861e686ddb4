"""Where a train_gpt rank's loop spends its time, from py-spy's raw samples.

Each sample of the main thread inside the training loop's lines is given to its innermost
frame that is either trainspec's own code (`TS`, with the torch calls it makes) or the
script's and workload's (`user`). Printed as milliseconds per step.

    py-spy record --subprocesses --nonblocking --rate 1000 --format raw -o on.raw -- \\
        python -m torch.distributed.run --nproc-per-node 1 examples/train_gpt.py \\
        --steps 600 --batch-size 256 --device cuda
    python docs/gpu/h100-2026-11-26c/attribute.py on.raw 1000 600 40
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"
SETUP = ("init (trainspec/__init__", "actuate (", "Session.close", "resume (")


def loop_lines() -> tuple[int, int]:
    """The first and last line of the training loop in examples/train_gpt.py."""
    src = SCRIPT.read_text().splitlines()
    first = next(i for i, line in enumerate(src, 1) if "for step in range(first_step" in line)
    last = next(i for i, line in enumerate(src, 1) if 'log["steps"].append' in line)
    return first, last


def in_loop(frames: list[str], lines: tuple[int, int]) -> bool:
    for frame in frames:
        if "main (" in frame and "train_gpt.py" in frame:
            return lines[0] <= int(frame.rsplit(":", 1)[1].rstrip(")")) <= lines[1]
    return False


def owner(frames: list[str]) -> str:
    for frame in reversed(frames):
        if "train_gpt.py" in frame:
            return "user " + frame.split("/")[-1]
        if "trainspec/workload" in frame:
            return "user " + frame.split(" (")[0]
        if "trainspec/" in frame:
            return "TS " + frame.split(" (")[0] + " " + frame.split("/")[-1]
    return "other " + frames[-1]


def main() -> int:
    path, rate, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    lines = loop_lines()
    by: collections.Counter[str] = collections.Counter()
    for row in Path(path).read_text().splitlines():
        stack, samples = row.rsplit(" ", 1)
        frames = stack.split(";")
        if in_loop(frames, lines) and not any(s in f for f in frames for s in SETUP):
            by[owner(frames)] += int(samples)
    ms = 1e3 / rate / steps
    own = sum(v for k, v in by.items() if k.startswith("TS"))
    print(f"{Path(path).name}: loop {sum(by.values()) * ms:.3f} ms/step sampled, "
          f"trainspec-innermost {own * ms:.3f} ms/step")  # fmt: skip
    for key, count in by.most_common(top):
        print(f"{count * ms:8.4f} ms/step {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
