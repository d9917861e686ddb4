"""Relative loss checks read a rise against the loss's magnitude, whatever its sign.

`loss > last * (1 + 0.05)` read -2.05 after -2.0 (an improvement of a negative objective: a
log-likelihood, an ELBO) as "the loss rose" and lowered compression; a previous loss of 0
made any positive loss degraded. The loss-spike detector's `loss > 1.5 * reference` flagged
every window of a negative loss (-2.0 > -3.0), each one a spike checkpoint (QA).
"""

from __future__ import annotations

import pytest

from tests.unit.test_actuator_detectors import window
from trainspec.actuator.compression import CompressionPolicy, loss_rose
from trainspec.actuator.loss import LossSpikeDetector


def _second_window(losses: tuple[float, float]):
    pol = CompressionPolicy(cooldown=0)
    for loss in losses:
        action = pol.decide(window([0.01], loss_mean=loss), "int8", comm_bound=False,
                            critical=False, exposed_share=0.0)  # fmt: skip
    return action


@pytest.mark.parametrize(
    ("losses", "lowered"),
    [
        ((2.0, 1.9), False),
        ((2.0, 2.05), False),  # 2.5%
        ((2.0, 2.5), True),
        ((-2.0, -2.05), False),  # fell: better
        ((-2.0, -1.95), False),  # rose 2.5% of its magnitude
        ((-2.0, -1.0), True),  # rose 50%
        ((-0.1, 0.5), True),  # crossed zero upwards
        ((0.0, 0.01), False),  # no scale to judge a rise from 0 by
        ((0.0, -0.5), False),
    ],
)
def test_compression_lowers_only_when_the_loss_rose_by_more_than_five_percent_of_it(
    losses, lowered
):
    action = _second_window(losses)
    if lowered:
        assert action is not None and action.after == {"level": "bf16"}
        assert "the loss rose" in action.reason
    else:
        assert action is None


def test_loss_rose_is_relative_to_the_magnitude():
    assert loss_rose(-2.0, -1.8, 0.05) and not loss_rose(-2.0, -1.95, 0.05)
    assert loss_rose(1e-9, 2e-9, 0.05)  # relative: small losses too
    assert not loss_rose(0.0, 1.0, 0.05) and not loss_rose(float("nan"), 5.0, 0.05)


def test_a_negative_loss_is_no_spike_while_it_falls():
    det = LossSpikeDetector(spike_factor=1.5)
    for loss in (-2.0, -2.0, -2.1, -2.3, -2.2):
        assert det.observe(window([0.01], loss_mean=loss)) == [], loss
    ref = det.reference
    found = det.observe(window([0.01], loss_mean=-0.5))  # rose by 3/4 of |reference|
    assert found and found[0].kind == "loss_spike" and det.reference == ref
    assert "above the running reference" in found[0].reason
    assert "of its magnitude (threshold 50%)" in found[0].reason


def test_a_positive_spike_reads_as_before_and_a_zero_reference_judges_nothing():
    det = LossSpikeDetector(spike_factor=1.5)
    det.observe(window([0.01], loss_mean=2.0))
    found = det.observe(window([0.01], loss_mean=4.0))
    assert found[0].kind == "loss_spike" and "2.0x the running reference 2" in found[0].reason
    assert det.observe(window([0.01], loss_mean=2.9)) == []  # 1.45x
    zero = LossSpikeDetector(spike_factor=1.5)
    zero.observe(window([0.01], loss_mean=0.0))
    assert zero.observe(window([0.01], loss_mean=0.01)) == []
