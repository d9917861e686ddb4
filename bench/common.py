"""Shared benchmark plumbing: arguments, A B A B scheduling, statistics, the printed table."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any

import psutil


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run")
    p.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    return p


# The workload's compute as a wait (trainspec/workload/device_time.py) over a small real model:
# the host's view of a GPU job, so ranks and telemetry threads do not fight over the cores.
SIMULATED_MODEL = ["--layers=1", "--embd=64", "--block-size=32"]


def add_simulate_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--simulate-device-ms",
        default=None,
        metavar="FIXED,PER_SAMPLE",
        help="compute is a wait of FIXED + PER_SAMPLE x samples ms per forward (backward 2x) "
        "on a small model, as a host waits on a GPU (trainspec/workload/device_time.py)",
    )


def simulate_device_args(spec: str | None) -> list[str]:
    """The training script's arguments for `--simulate-device-ms spec` (none when unset)."""
    return [f"--simulate-device-ms={spec}", *SIMULATED_MODEL] if spec else []


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "logical_cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    fmt = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in fmt)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for r in fmt:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def write_json(path: str | None, figures: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps({"machine": machine(), **figures}, indent=1))
