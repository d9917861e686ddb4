"""The example's bad settings are one line and exit 2, not a traceback per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "args", "names"),
    [
        ({"TRAINSPEC_INJECT": "slow:rank=0,factor=2"}, [], "TRAINSPEC_ALLOW_INJECT=1"),
        ({"TRAINSPEC_INJECT": "slow:rank=zero", "TRAINSPEC_ALLOW_INJECT": "1"}, [], "rank"),
        ({}, ["--micro-batch", "-3"], "micro_batch"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, env, args, names):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSPEC_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--run-root", str(tmp_path), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("train_gpt.py:")]
    assert len(lines) == 1 and names in lines[0], proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_bad_config_file_value_is_one_line_and_exit_2(tmp_path):
    """trainspec.init sat outside the example's error handling: a traceback per rank."""
    config = tmp_path / "bad.toml"
    config.write_text("[actuator]\nwindow_steps = -1\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSPEC_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--run-root", str(tmp_path)],
        env={**clean, "TRAINSPEC_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "actuator.window_steps" in lines[0], proc.stderr[-3000:]
    assert lines[0].startswith("train_gpt.py:") and str(config) in lines[0]
