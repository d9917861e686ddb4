"""Policies on synthetic summaries: bounds, patience, cool-down, no oscillation."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.unit.test_actuator_detectors import window
from trainspec.actuator.checkpointing import CheckpointPolicy
from trainspec.actuator.compression import CompressionPolicy
from trainspec.actuator.findings import Finding
from trainspec.actuator.rebalance import RebalancePolicy
from trainspec.actuator.speed_model import (
    Line,
    SpeedModel,
    balanced_shares,
    integer_balanced_shares,
    predicted_step_s,
)
from trainspec.actuator.summary import FLAG_NAN_LOSS


def test_integer_shares_sum_to_the_batch_and_keep_the_minimum():
    per_sample = lambda *ts: [Line(0.0, t) for t in ts]  # noqa: E731
    assert integer_balanced_shares(per_sample(0.01, 0.02), 16, 1) == [11, 5]
    assert integer_balanced_shares(per_sample(0.01, 1e9), 16, 2) == [14, 2]
    shares = integer_balanced_shares(per_sample(1.0, 1 / 0.7, 1 / 0.3, 1 / 0.9), 1000, 1)
    assert sum(shares) == 1000 and shares[0] > shares[3] > shares[1] > shares[2]
    with pytest.raises(ValueError, match="min_share"):
        integer_balanced_shares(per_sample(1.0, 1.0), 3, 2)


def test_integer_shares_are_the_best_split_under_the_lines():
    # Against brute force on random lines with fixed costs: no split finishes sooner.
    rng = random.Random(7)
    for _ in range(200):
        ranks, total = rng.randint(2, 3), rng.randint(3, 14)
        lines = [Line(rng.uniform(0, 0.05), rng.uniform(0.001, 0.02)) for _ in range(ranks)]
        shares = integer_balanced_shares(lines, total, 1)
        splits = [s for s in itertools.product(range(1, total + 1), repeat=ranks)
                  if sum(s) == total]  # fmt: skip
        best = min(predicted_step_s(list(s), lines) for s in splits)
        assert sum(shares) == total and min(shares) >= 1
        assert predicted_step_s(shares, lines) == pytest.approx(best), (lines, total, shares)


def test_rebalance_waits_for_patience_then_moves_toward_speed():
    pol = RebalancePolicy(16, 2, min_gain=0.1, patience=2, max_change=1.0, cooldown=0)
    slow = window([0.01, 0.02])
    assert pol.decide(slow, [8, 8]) is None
    action = pol.decide(slow, [8, 8])
    assert action is not None and action.after["shares"] == [11, 5]
    assert action.before == {"shares": [8, 8]} and sum(action.after["shares"]) == 16
    assert "global batch stays 16" in action.reason


def test_rebalance_change_is_bounded_per_decision():
    pol = RebalancePolicy(32, 2, patience=1, max_change=0.25, cooldown=0)  # <= 4 samples
    action = pol.decide(window([0.01, 0.05]), [16, 16])
    new = action.after["shares"]
    assert sum(new) == 32 and max(abs(a - b) for a, b in zip(new, [16, 16])) <= 4


def test_rebalance_cools_down_and_counts_afresh_after_an_action():
    pol = RebalancePolicy(16, 2, patience=1, max_change=0.25, cooldown=2)
    slow = window([0.01, 0.03])
    first = pol.decide(slow, [8, 8]).after["shares"]
    assert pol.decide(slow, first) is None and pol.decide(slow, first) is None  # cooling
    assert pol.decide(slow, first) is not None


def test_rebalance_keeps_min_share_and_ignores_small_gains():
    pol = RebalancePolicy(8, 2, patience=1, max_change=1.0, min_share=2, cooldown=0)
    assert pol.decide(window([0.01, 1.0]), [4, 4]).after["shares"] == [6, 2]
    calm = RebalancePolicy(16, 2, min_gain=0.1, patience=1)
    assert calm.decide(window([0.01, 0.0105]), [8, 8]) is None


def test_rebalance_settles_without_oscillating_under_noise():
    # Per-step compute has a fixed part and a per-sample part (rank 1 is 2x slower per sample),
    # both with +-10% noise: the policy must settle near the ideal and then stay put.
    rng = random.Random(3)
    pol = RebalancePolicy(32, 2, min_gain=0.1, patience=2, max_change=0.5, cooldown=1)
    shares, actions = [16, 16], 0
    for _ in range(60):
        per_sample = []
        for r, n in enumerate(shares):
            work = (0.002 + n * 0.001 * (2 if r == 1 else 1)) * rng.uniform(0.9, 1.1)
            per_sample.append(work / n)
        action = pol.decide(window(per_sample, samples=1), shares)
        if action is not None:
            shares, actions = action.after["shares"], actions + 1
    assert actions <= 3 and sum(shares) == 32
    truth = [Line(0.002, 0.001), Line(0.002, 0.002)]
    ideal = predicted_step_s([21, 11], truth)
    assert predicted_step_s(shares, truth) <= ideal * 1.1, shares


def test_compression_raises_when_comm_bound_and_lowers_in_critical_regimes():
    pol = CompressionPolicy(cooldown=1)
    s = window([0.01, 0.01])
    up = pol.decide(s, "none", comm_bound=True, critical=False, exposed_share=0.4)
    assert (up.before, up.after) == ({"level": "none"}, {"level": "bf16"})
    assert pol.decide(s, "bf16", comm_bound=True, critical=False, exposed_share=0.4) is None
    down = pol.decide(s, "bf16", comm_bound=True, critical=True, exposed_share=0.4)
    assert down.after == {"level": "none"} and "critical" in down.reason
    assert pol.decide(s, "none", comm_bound=True, critical=True, exposed_share=0.4) is None


def test_compression_lowers_when_loss_degrades_and_stops_at_the_top():
    pol = CompressionPolicy(cooldown=0)
    assert pol.decide(window([0.01], loss_mean=2.0), "int8", comm_bound=True, critical=False,
                      exposed_share=0.5) is None  # fmt: skip
    down = pol.decide(window([0.01], loss_mean=2.5), "int8", comm_bound=True, critical=False,
                      exposed_share=0.5)  # fmt: skip
    assert down.after == {"level": "bf16"} and "loss rose" in down.reason


def test_compression_finds_a_level_however_the_ladder_spelled_it():
    """The hook reports `topk:0.01` for a ladder's `topk:.01` (and `int8` for `INT8:256`):
    read as rung 0, a critical regime would not lower it and a comm-bound one would 'raise'
    it back down the ladder."""
    pol = CompressionPolicy(ladder=("none", "INT8:256", "topk:.01"), cooldown=0)
    assert pol.ladder == ("none", "int8", "topk:0.01")
    s = window([0.01])
    assert pol.decide(s, "topk:0.01", comm_bound=True, critical=False, exposed_share=0.5) is None
    down = pol.decide(s, "topk:0.01", comm_bound=True, critical=True, exposed_share=0.5)
    assert down.after == {"level": "int8"}


def test_a_level_off_the_ladder_is_left_where_it_is_with_a_warning(caplog):
    """`kernels.compression = lowrank:2` with the default ladder was read as rung 0: a
    comm-bound window 'raised' it to bf16, 5.4x the bytes (QA sweep)."""
    pol = CompressionPolicy(cooldown=0)
    s = window([0.01])
    with caplog.at_level("WARNING", logger="trainspec.actuator"):
        advice = pol.decide(s, "lowrank:2", comm_bound=True, critical=False, exposed_share=0.5)
    assert advice.kind == "advice" and not advice.changes_state
    assert "lowrank:2 is not on actuator.compression_ladder (none,bf16,int8)" in advice.reason
    assert len(caplog.records) == 1 and "lowrank:2" in caplog.records[0].getMessage()
    for critical in (False, True, False):  # said once; never moved, up or down
        assert pol.decide(s, "lowrank:2", comm_bound=True, critical=critical,
                          exposed_share=0.5) is None  # fmt: skip
    up = pol.decide(s, "none", comm_bound=True, critical=False, exposed_share=0.5)
    assert up.after == {"level": "bf16"}  # back on the ladder, it moves as before


def test_a_plain_int8_rung_is_the_jobs_int8_block():
    """With `kernels.int8_block_size = 64` the hook runs and reports `int8:64`; a ladder's
    plain `int8` must be that rung, or the policy reads the job as at rung 0 and a comm-bound
    window 'raises' it to bf16, and a move to `int8` would drop the configured block."""
    pol = CompressionPolicy(ladder=("none", "bf16", "int8", "int8:256"), int8_block=64,
                            cooldown=0)  # fmt: skip
    assert pol.ladder == ("none", "bf16", "int8:64", "int8")
    s = window([0.01])
    up = pol.decide(s, "int8:64", comm_bound=True, critical=False, exposed_share=0.5)
    assert up.after == {"level": "int8"}  # the explicit 256 rung above it
    down = pol.decide(s, "int8:64", comm_bound=True, critical=True, exposed_share=0.5)
    assert down.after == {"level": "bf16"}
    up = pol.decide(s, "bf16", comm_bound=True, critical=False, exposed_share=0.5)
    assert up.after == {"level": "int8:64"}


def test_checkpoint_first_measures_cost_then_follows_the_interval():
    pol = CheckpointPolicy(lambda cost, step_s: int(cost / step_s) * 10)
    s = window([0.01, 0.01])
    assert pol.decide(s, 5, []).evidence == {}
    assert pol.decide(s, 10, []) is None  # cost not known yet: nothing periodic
    s = window([0.01, 0.01], checkpoint_cost_s=[0.5, 1.0], duration_s=0.5)  # 0.1 s/step
    assert pol.decide(s, 50, []) is None and pol.interval == 100
    assert pol.decide(s, 105, []).after == {"step": 105}


def test_a_checkpoint_that_reports_no_cost_is_taken_again_with_a_backoff():
    """A failed first save (a read-only directory) reports no cost: the policy waited for
    one for ever, and the job never checkpointed again (QA case ckro2)."""
    pol = CheckpointPolicy(lambda cost, step_s: int(cost / step_s) * 10)
    s = window([0.01, 0.01])
    taken = [step for step in range(6, 400, 5) if pol.decide(s, step, [])]
    assert taken == [6, 16, 36, 76, 156, 316]  # after 2, 4, 8, 16, 32 windows
    later = [step for step in range(401, 1200, 5) if pol.decide(s, step, [])]
    assert later and all(b - a == 160 for a, b in itertools.pairwise([316, *later]))
    measured = window([0.01, 0.01], checkpoint_cost_s=0.5, duration_s=0.5)  # 0.1 s/step
    assert pol.decide(measured, later[-1] + 5, []) is None and pol.interval == 50
    assert pol.decide(measured, later[-1] + 50, []).evidence["interval_steps"] == 50


def test_checkpoint_at_once_on_a_loss_spike_or_preemption():
    pol = CheckpointPolicy(lambda c, s: 10**6)
    pol.last_step = 1
    action = pol.decide(window([0.01]), 7, [Finding("loss_spike", "x"), Finding("preemption", "y")])
    assert action.after == {"step": 7} and "loss spike, preemption signal" in action.reason
    assert pol.decide(window([0.01]), 8, [Finding("loss_spike", "x", cleared=True)]) is None


@pytest.mark.parametrize("bad", [0.0, 1.5])
def test_rebalance_rejects_bad_bounds(bad):
    with pytest.raises(ValueError, match="max_change"):
        RebalancePolicy(16, 2, max_change=bad)


def test_equal_shares_move_only_while_a_straggler_is_flagged():
    pol = RebalancePolicy(16, 2, min_gain=0.05, patience=1, cooldown=0)
    uneven_noise = window([0.005, 0.006])  # a 20% gap below the straggler threshold
    assert pol.decide(uneven_noise, [8, 8], straggling=False) is None
    assert pol.decide(uneven_noise, [8, 8], straggling=True) is not None
    # shares already moved may move back once the straggler has recovered
    recovered = window([0.005, 0.005])
    for summary, n in zip(recovered, [13, 3]):  # measured at the shares it now runs
        summary.samples, summary.compute_s = 5 * n, 0.005 * 5 * n
    back = pol.decide(recovered, [13, 3], straggling=False)
    assert back is not None and back.after["shares"] == [8, 8]


def test_speed_model_fits_a_fixed_cost_from_two_shares_and_balances_on_it():
    model = SpeedModel()
    for shares in ([8, 8], [12, 4]):
        # rank 0: 2 ms + 1 ms/sample; rank 1: 4 ms + 3 ms/sample
        per_step = [0.002 + 0.001 * shares[0], 0.004 + 0.003 * shares[1]]
        s = window([c / n for c, n in zip(per_step, shares)])
        for summary, n, c in zip(s, shares, per_step):
            summary.steps, summary.samples, summary.compute_s = 1, n, c
        model.observe(s)
    lines = model.lines(s)
    assert [round(x.fixed_s, 6) for x in lines] == [0.002, 0.004]
    assert [round(x.per_sample_s, 6) for x in lines] == [0.001, 0.003]
    exact = balanced_shares(lines, 16)
    assert sum(exact) == pytest.approx(16)
    assert lines[0].at(exact[0]) == pytest.approx(lines[1].at(exact[1]))


def test_speed_model_falls_back_to_per_sample_time_on_an_implausible_fit():
    model = SpeedModel()
    for n, c in ((8, 0.010), (4, 0.012)):  # fewer samples, more time: noise, not a line
        s = window([c / n])
        s[0].steps, s[0].samples, s[0].compute_s = 1, n, c
        model.observe(s)
    assert model.lines(s)[0] == Line(0.0, 0.012 / 4)


def test_an_async_saves_cost_reaches_the_policy_once_it_completes():
    """The action that starts an async save returns before the save completes: its cost was
    never known, and no Young/Daly checkpoint ever followed the first."""
    from trainspec.actuator.actions import Targets

    done: list[float] = []
    targets = Targets(rank=0, global_batch=8, checkpoint=lambda step, reason: None,
                      checkpoint_cost_source=lambda: done[-1] if done else None)  # fmt: skip
    assert targets.latest_checkpoint_cost() is None
    done.append(1.5)  # the save committed on its worker thread
    assert targets.latest_checkpoint_cost() == 1.5
    assert targets.checkpoint_cost_s == 1.5


def test_a_loss_spike_that_lasts_checkpoints_once_per_episode():
    """A loss that stays high is reported as a spike every window (the reference does not
    move on spike windows): it checkpointed every window, rotating the last good
    checkpoint out (QA B1, spk). One save per episode; a new episode saves again."""
    pol = CheckpointPolicy(lambda c, s: 10**6)
    pol.last_step = 1
    s = window([0.01], checkpoint_cost_s=0.5)  # measured: nothing periodic for 10**6 steps
    spike = [Finding("loss_spike", "x")]
    taken = [step for step in (6, 11, 16, 21) if pol.decide(s, step, spike)]
    assert taken == [6] and pol.anomaly == "loss spike since step 6"
    assert pol.decide(s, 26, []) is None and pol.anomaly is None  # it ended
    again = pol.decide(s, 31, spike)
    assert again is not None and again.after == {"step": 31} and "loss spike" in again.reason
    hardware = [Finding("hardware", "y")]  # any urgent trigger: once while it lasts
    assert pol.decide(s, 36, hardware).evidence == {"triggers": ["hardware"]}
    assert pol.decide(s, 41, hardware) is None


def test_no_checkpoint_is_taken_of_a_state_whose_loss_is_not_finite():
    """A non-finite loss checkpointed at once and every window after it: each save held NaN
    weights, and keep_last rotated the good ones out (QA B1). No save of any kind while it
    lasts, one advice, and periodic saves again once the loss is finite."""
    pol = CheckpointPolicy(lambda c, s: 10)
    measured = {"checkpoint_cost_s": 0.5, "duration_s": 0.5}
    assert pol.decide(window([0.01], **measured), 5, []).after == {"step": 5}
    nan = [Finding("loss_nan", "x", severity="error")]
    first = pol.decide(window([0.01], **measured), 20, nan)  # the interval was reached, too
    assert first is not None and first.kind == "advice" and "no checkpoint" in first.reason
    assert pol.anomaly == "non-finite loss since step 20"
    assert pol.decide(window([0.01], **measured), 25, nan) is None
    flagged = window([0.01], flags=FLAG_NAN_LOSS, **measured)  # the flag alone says it too
    assert pol.decide(flagged, 30, []) is None and pol.last_step == 5
    periodic = pol.decide(window([0.01], **measured), 35, [])
    assert periodic is not None and periodic.kind == "checkpoint" and pol.anomaly is None
