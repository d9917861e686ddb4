"""Run one of the kernel check scripts (tests/integration/scripts/*_check.py) in a fresh
interpreter and return the figures it printed as its last line (JSON).

A subprocess because TRITON_INTERPRET must be set, or unset, before Triton compiles
anything: `interpret=True` runs the Triton kernels on the CPU through Triton's interpreter;
False runs them compiled (on a GPU), with the interpreter switched off whatever the caller's
environment says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "integration" / "scripts"


def run_check_script(name: str, *, interpret: bool, timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures
