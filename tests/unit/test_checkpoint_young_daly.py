from __future__ import annotations

import math

import pytest

from trainspec.runtime.young_daly import (
    daly_interval_s,
    interval_steps,
    job_mtbf_s,
    young_interval_s,
)


def test_young_interval_is_sqrt_two_cost_mtbf() -> None:
    assert young_interval_s(10.0, 3600.0) == pytest.approx(math.sqrt(72_000.0))
    assert young_interval_s(0.0, 100.0) == 0.0


def test_job_mtbf_divides_by_gpu_count() -> None:
    # 50,000 GPU-hours per failure over 1,024 GPUs: about 48.8 h per job failure.
    assert job_mtbf_s(50_000 * 3600.0, 1024) == pytest.approx(50_000 * 3600.0 / 1024)


def test_daly_is_close_to_young_for_cheap_checkpoints_and_capped_for_costly() -> None:
    young, daly = young_interval_s(1.0, 1e6), daly_interval_s(1.0, 1e6)
    assert abs(daly - young) / young < 0.01
    assert daly_interval_s(300.0, 100.0) == 100.0
    # Daly's correction grows as cost approaches MTBF, minus the cost itself.
    c, m = 50.0, 1000.0
    r = c / (2 * m)
    assert daly_interval_s(c, m) == pytest.approx(
        math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c
    )


def test_interval_in_steps_rounds_and_has_a_floor() -> None:
    # cost 2 s, 8 GPUs at 8,000 h each: job MTBF 1,000 h; interval sqrt(2*2*3.6e6) = 3,795 s.
    assert interval_steps(2.0, 0.5, 8000 * 3600.0, 8) == round(math.sqrt(2 * 2.0 * 3.6e6) / 0.5)
    assert interval_steps(0.0, 0.5, 3600.0, 1, min_steps=5) == 5


@pytest.mark.parametrize(
    "call",
    [
        lambda: young_interval_s(-1.0, 10.0),
        lambda: young_interval_s(1.0, 0.0),
        lambda: job_mtbf_s(10.0, 0),
        lambda: job_mtbf_s(-5.0, 2),
        lambda: interval_steps(1.0, 0.0, 10.0, 1),
        lambda: daly_interval_s(float("nan"), 10.0),
    ],
)
def test_bad_inputs_are_refused(call) -> None:
    with pytest.raises(ValueError):
        call()
