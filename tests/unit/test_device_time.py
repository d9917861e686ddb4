"""The simulated device wait: parsing, and that forward and backward really wait."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from trainspec.workload.device_time import BACKWARD_TO_FORWARD, SimulatedDevice


def test_parse_milliseconds() -> None:
    sim = SimulatedDevice.parse("2,0.5")
    assert sim.fixed_s == pytest.approx(0.002)
    assert sim.forward_s(8) == pytest.approx(0.002 + 8 * 0.0005)


@pytest.mark.parametrize("text", ["1", "a,b", "1,2,3", "-1,1", "1,0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="simulate-device-ms"):
        SimulatedDevice.parse(text)


def test_wait_is_identity_and_waits_in_forward_and_backward() -> None:
    sim = SimulatedDevice(fixed_s=0.0, per_sample_s=0.004)
    w = torch.tensor(3.0, requires_grad=True)
    t0 = time.perf_counter()
    loss = sim.wait(w * 2, samples=5)  # 20 ms forward, 40 ms backward
    fwd = time.perf_counter() - t0
    t1 = time.perf_counter()
    loss.backward()
    bwd = time.perf_counter() - t1
    assert loss.item() == 6.0 and w.grad is not None and w.grad.item() == 2.0
    assert fwd >= 0.020 and bwd >= BACKWARD_TO_FORWARD * 0.020


def test_example_is_the_packaged_script() -> None:
    root = Path(__file__).resolve().parents[2]
    example = root / "examples" / "train_gpt.py"
    packaged = root / "src" / "trainspec" / "workload" / "train_gpt.py"
    assert example.read_bytes() == packaged.read_bytes()
