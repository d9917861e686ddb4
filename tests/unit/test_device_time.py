"""The simulated device wait: parsing, and that forward and backward really wait."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainspec.workload.device_time import BACKWARD_TO_FORWARD, SimulatedDevice


def test_parse_milliseconds() -> None:
    sim = SimulatedDevice.parse("2,0.5")
    assert sim.fixed_s == pytest.approx(0.002)
    assert sim.forward_s(8) == pytest.approx(0.002 + 8 * 0.0005)


@pytest.mark.parametrize("text", ["1", "a,b", "1,2,3", "-1,1", "1,0", "inf,1", "1,nan"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="simulate-device-ms"):
        SimulatedDevice.parse(text)


def test_waits_forward_then_twice_for_backward() -> None:
    sim = SimulatedDevice(fixed_s=0.002, per_sample_s=0.004)
    t0 = time.perf_counter()
    sim.wait_forward(4)  # 18 ms
    t1 = time.perf_counter()
    sim.wait_backward(4)  # 36 ms
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.018 and t2 - t1 >= BACKWARD_TO_FORWARD * 0.018


def test_example_is_the_packaged_script() -> None:
    root = Path(__file__).resolve().parents[2]
    example = root / "examples" / "train_gpt.py"
    packaged = root / "src" / "trainspec" / "workload" / "train_gpt.py"
    assert example.read_bytes() == packaged.read_bytes()
