"""Detectors on synthetic window summaries: thresholds, hysteresis, noise."""

from __future__ import annotations

import math
import random

import pytest

from trainspec.actuator.bottlenecks import CommBoundDetector, InputBoundDetector
from trainspec.actuator.loss import LossSpikeDetector
from trainspec.actuator.memory import MemoryPressureDetector
from trainspec.actuator.regime import GradientRegimeDetector
from trainspec.actuator.straggler import StragglerDetector, performance_scores
from trainspec.actuator.summary import FLAG_NAN_LOSS, RankSummary, WindowAccumulator, step_compute_s
from trainspec.collector.records import StepRecord


def window(per_sample: list[float], samples: int = 40, **kw) -> list[RankSummary]:
    out = []
    for r, t in enumerate(per_sample):
        s = RankSummary(rank=r, steps=5, samples=samples, compute_s=t * samples, duration_s=1.0)
        for k, v in kw.items():
            setattr(s, k, v[r] if isinstance(v, list) else v)
        out.append(s)
    return out


def test_summary_round_trips_through_a_float_vector():
    s = RankSummary(rank=3, steps=5, samples=17, compute_s=0.25, flags=FLAG_NAN_LOSS, share=9)
    back = RankSummary.from_list(s.to_list())
    assert back == s and isinstance(back.samples, int) and len(s.to_list()) == RankSummary.width()


def test_step_compute_excludes_the_wait_for_other_ranks():
    rec = StepRecord(ts=0, rank=0, step=0, duration_s=1.0, forward_s=0.2, backward_s=0.5,
                     comm_exposed_s=0.3)  # fmt: skip
    assert step_compute_s(rec) == pytest.approx(0.4)
    bare = StepRecord(ts=0, rank=0, step=0, duration_s=1.0, data_wait_s=0.1, comm_exposed_s=0.2)
    assert step_compute_s(bare) == pytest.approx(0.7)


def test_accumulator_flags_a_nan_loss_and_resets_per_window():
    acc = WindowAccumulator(rank=1)
    acc.add(StepRecord(ts=0, rank=1, step=0, duration_s=0.1, samples=4, loss=2.0))
    acc.add(StepRecord(ts=0, rank=1, step=1, duration_s=0.1, samples=4, loss=math.nan))
    s = acc.take(plan_version=2, share=4, memory=(0.5, 0.0), ckpt_cost_s=math.nan)
    assert (s.steps, s.samples, s.flags & FLAG_NAN_LOSS, s.loss_mean) == (2, 8, FLAG_NAN_LOSS, 2.0)
    assert acc.take(plan_version=2, share=4, memory=(0, 0), ckpt_cost_s=math.nan).steps == 0


def test_per_sample_time_uses_the_median_step():
    acc = WindowAccumulator(rank=0)
    for compute in (0.04, 0.04, 0.40, 0.04, 0.04):  # one step hit by a neighbour's burst
        acc.add(StepRecord(ts=0, rank=0, step=0, duration_s=0.5, forward_s=compute / 2,
                           backward_s=compute / 2, samples=8))  # fmt: skip
    s = acc.take(plan_version=0, share=8, memory=(0, 0), ckpt_cost_s=math.nan)
    assert s.per_sample_s == pytest.approx(0.005) and s.compute_s == pytest.approx(0.56)


def test_scores_are_best_over_own_time():
    assert performance_scores(window([0.01, 0.02])) == pytest.approx([1.0, 0.5])


def test_straggler_enters_only_after_patience_and_leaves_with_hysteresis():
    det = StragglerDetector(enter_score=0.8, exit_score=0.9, patience=2)
    assert det.observe(window([0.01, 0.02])) == []  # one window below: not yet
    found = det.observe(window([0.01, 0.02]))
    assert [(f.kind, f.ranks, f.cleared) for f in found] == [("straggler", (1,), False)]
    assert "2.00x slower" in found[0].reason
    # between the thresholds: neither enters again nor clears
    for _ in range(5):
        assert det.observe(window([0.01, 0.0117])) == []
    assert det.observe(window([0.01, 0.0105])) == []
    cleared = det.observe(window([0.01, 0.0105]))
    assert [(f.ranks, f.cleared) for f in cleared] == [((1,), True)]


def test_straggler_ignores_noise_in_a_healthy_run():
    rng = random.Random(7)
    det = StragglerDetector()
    found = []
    for _ in range(200):  # +-12% per-rank noise on every window
        found += det.observe(window([0.01 * rng.uniform(0.88, 1.12) for _ in range(4)]))
    assert found == []


def test_straggler_rejects_inverted_thresholds():
    with pytest.raises(ValueError, match="enter_score"):
        StragglerDetector(enter_score=0.9, exit_score=0.8)


def test_comm_bound_uses_the_rank_that_waits_least():
    det = CommBoundDetector(enter_share=0.3, exit_share=0.2, patience=2)
    behind_straggler = window([0.01, 0.02], comm_exposed_s=[0.6, 0.0])  # fast rank waits
    assert det.observe(behind_straggler) == [] and det.observe(behind_straggler) == []
    bound = window([0.01, 0.01], comm_exposed_s=[0.4, 0.35])
    assert det.observe(bound) == []
    assert [f.kind for f in det.observe(bound)] == ["comm_bound"] and det.active
    free = window([0.01, 0.01], comm_exposed_s=0.1)
    det.observe(free)
    assert det.observe(free)[0].cleared and not det.active


def test_input_bound_names_the_waiting_rank():
    det = InputBoundDetector(enter_share=0.2, exit_share=0.1, patience=1)
    found = det.observe(window([0.01, 0.01], data_wait_s=[0.05, 0.5]))
    assert found[0].ranks == (1,) and found[0].evidence["data_wait_share"] == 0.5


def test_gradient_regime_follows_accordion_relative_norm_change():
    det = GradientRegimeDetector(eta=0.5)
    assert det.observe(window([0.01], grad_norm=10.0)) == []
    assert det.observe(window([0.01], grad_norm=9.0))[0].cleared  # 10% change: not critical
    assert not det.critical
    found = det.observe(window([0.01], grad_norm=3.0))  # 67% change
    assert det.critical and found[0].kind == "gradient_regime" and not found[0].cleared


def test_loss_spike_against_a_reference_that_spikes_do_not_move():
    det = LossSpikeDetector(spike_factor=1.5)
    for loss in (3.0, 2.9, 2.8):
        assert det.observe(window([0.01], loss_mean=loss)) == []
    ref = det.reference
    assert det.observe(window([0.01], loss_mean=9.0))[0].kind == "loss_spike"
    assert det.reference == ref
    nan = det.observe(window([0.01, 0.01], flags=[0, FLAG_NAN_LOSS]))
    assert nan[0].kind == "loss_nan" and nan[0].ranks == (1,)


def test_memory_pressure_from_level_or_new_allocator_retries():
    det = MemoryPressureDetector(enter=0.9, exit=0.8, patience=1)
    assert det.observe(window([0.01], memory_pressure=0.5)) == []
    found = det.observe(window([0.01], memory_pressure=0.5, alloc_retries=3.0))
    assert found and found[0].kind == "memory_pressure"
