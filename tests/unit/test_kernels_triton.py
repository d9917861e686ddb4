"""The Triton int8 kernels against the torch reference, on CPU through Triton's interpreter.

Runs in a subprocess because TRITON_INTERPRET must be set before Triton compiles anything.
Skipped, with the reason, where Triton is not installed (it is optional: `trainspec[triton]`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "integration" / "scripts" / "kernels_triton_check.py"


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_torch_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cases"] == 20
    assert result["codes_mismatch"] <= 1
    assert result["scale_max_abs"] == 0.0
    assert result["residual_max_abs"] < 1e-5
    assert result["acc_max_abs"] < 1e-5
    assert result["codec_max_abs"] < 1e-5


def test_triton_backend_without_triton_says_so() -> None:
    from trainspec.kernels import triton_int8

    if triton_int8.available():
        pytest.skip("triton is installed here; the missing-dependency path cannot be shown")
    import torch

    with pytest.raises(RuntimeError, match="triton is not installed"):
        triton_int8.quantize_with_feedback(torch.ones(4), 1.0, None, 256)


def test_triton_needs_a_power_of_two_block() -> None:
    from trainspec.kernels import triton_int8

    if not triton_int8.available():
        pytest.skip("triton is not installed")
    import torch

    with pytest.raises(ValueError, match="power-of-two"):
        triton_int8.quantize_with_feedback(torch.ones(4), 1.0, None, 100)
