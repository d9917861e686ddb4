"""HookSet: several models' gradient hooks driven as one (runtime/hook_set.py)."""

from __future__ import annotations

import math

import pytest

from trainspec.kernels import parse_level
from trainspec.kernels.stats import GradientStats
from trainspec.runtime.hook_set import HookSet


class FakeHook:
    """The CompressionHook surface a HookSet drives, recording what it was asked."""

    def __init__(self, step: int = 0, level: str = "none") -> None:
        self.step = step
        self.level = self.next_level = level
        self.calls: list[tuple] = []
        self.summary: GradientStats | None = None
        self.terms: tuple[float, float] | None = None
        self.pieces: dict[int, object] = {}

    def set_level(self, level: str, at_step=None, *, reset_error_feedback=False) -> None:
        parse_level(level)  # a bad level raises, as the real hook's does
        self.calls.append(("set_level", level, at_step, reset_error_feedback))
        self.next_level = level

    def set_shares(self, local: int, total: int) -> None:
        self.calls.append(("set_shares", local, total))

    def error_feedback(self) -> dict[int, object]:
        return dict(self.pieces)

    def restore_error_feedback(self, pieces: dict[int, object]) -> None:
        self.calls.append(("restore", dict(pieces)))

    def step_summary(self) -> GradientStats | None:
        s, self.summary = self.summary, None
        return s

    def held_noise_terms(self) -> tuple[float, float] | None:
        return self.terms


def stats(norm: float, variance: float | None, nbytes: int, seconds: float, ready: float,
          level: str = "none", terms: tuple[float, float] | None = None) -> GradientStats:  # fmt: skip
    return GradientStats(
        step=0, level=level, grad_norm=norm, grad_variance=variance, grad_noise_scale=None,
        comm_bytes=nbytes, allreduce_s=seconds, local_grad_norm=norm, world_size=2,
        global_batch=8, last_bucket_ready=ready, noise_terms=terms,
    )  # fmt: skip


def pair(a: FakeHook, b: FakeHook) -> HookSet:
    return HookSet([a, b], [{1, 3}, {2}])  # model a's parameters 1 and 3, model b's 2


def test_needs_two_hooks_each_with_its_ids():
    with pytest.raises(ValueError, match="two or more"):
        HookSet([FakeHook()], [set()])
    with pytest.raises(ValueError, match="two or more"):
        HookSet([FakeHook(), FakeHook()], [set()])


def test_control_reaches_every_hook():
    a, b = FakeHook(), FakeHook()
    hooks = pair(a, b)
    hooks.set_shares(6, 8)
    for h in (a, b):
        assert ("set_shares", 6, 8) in h.calls
    # Each hook takes back its own model's pieces only.
    hooks.restore_error_feedback({1: "x", 2: "y", 3: "z"})
    assert a.calls[-1] == ("restore", {1: "x", 3: "z"}) and b.calls[-1] == ("restore", {2: "y"})
    # A checkpoint of one model (actuate's) leaves the other's error feedback as it is.
    b.calls.clear()
    hooks.restore_error_feedback({1: "x"})
    assert b.calls == []
    # Nothing saved: every model starts without error feedback.
    hooks.restore_error_feedback({})
    assert a.calls[-1] == ("restore", {}) and b.calls[-1] == ("restore", {})
    # A hook holding another model's stale piece (restored to it before) cannot pass it off
    # as that model's current one.
    a.pieces, b.pieces = {1: "ra", 3: "ra3"}, {2: "rb", 1: "stale"}
    assert hooks.error_feedback() == {1: "ra", 3: "ra3", 2: "rb"}


def test_a_switch_lands_the_same_number_of_steps_ahead_on_each_hook():
    # A discriminator's hook runs twice a step: its own step count runs ahead.
    gen, disc = FakeHook(step=5), FakeHook(step=11)
    hooks = pair(gen, disc)
    assert hooks.step == 5
    hooks.set_level("int8", at_step=7, reset_error_feedback=True)
    assert gen.calls[-1] == ("set_level", "int8", 7, True)
    assert disc.calls[-1] == ("set_level", "int8", 13, True)
    hooks.set_level("bf16")  # the next step of each
    assert gen.calls[-1][2] is None and disc.calls[-1][2] is None
    assert hooks.next_level == "bf16"
    # One model may run a switch before the other: the set's level is the first model's,
    # one rung of the actuator's ladder, never a pair.
    gen.level, disc.level = "int8", "none"
    assert hooks.level == "int8"
    with pytest.raises(ValueError, match="step 4"):
        hooks.set_level("none", at_step=4)


def test_a_bad_level_switches_no_hook():
    a, b = FakeHook(), FakeHook()
    with pytest.raises(ValueError):
        pair(a, b).set_level("int9")
    assert a.calls == [] and b.calls == []


def test_statistics_are_those_of_the_concatenated_gradient():
    a, b = FakeHook(), FakeHook()
    hooks = pair(a, b)
    assert hooks.step_summary() is None  # neither model ran a backward
    a.summary = stats(3.0, 10.0, 100, 0.01, ready=5.0, terms=(10.0, 9.0))
    b.summary = stats(4.0, 2.5, 40, 0.02, ready=7.0, level="int8", terms=(2.0, 16.0))
    a.terms = b.terms = (99.0, 1.0)  # the hooks' terms by now: a later step's, not read
    s = hooks.step_summary()
    assert s is not None
    assert s.grad_norm == pytest.approx(5.0)  # sqrt(3^2 + 4^2)
    assert s.grad_variance == pytest.approx(12.5)  # tr(Sigma) adds over parameters
    assert s.grad_noise_scale == pytest.approx(12.0 / 25.0)  # summed terms' ratio
    assert s.comm_bytes == 140 and s.allreduce_s == pytest.approx(0.03)
    assert s.last_bucket_ready == 7.0
    assert s.compression == "none+int8"
    assert hooks.step_summary() is None  # each step's statistics once


def test_one_model_without_a_fresh_backward_or_an_estimate():
    a, b = FakeHook(), FakeHook()
    hooks = pair(a, b)
    a.summary = stats(2.0, None, 10, 0.01, ready=1.0, terms=(1.0, 1.0))
    # b has no noise estimate yet: no combined noise scale
    s = hooks.step_summary()
    assert s is not None and s.grad_norm == pytest.approx(2.0)
    assert s.grad_variance is None and s.grad_noise_scale is None
    assert not math.isnan(s.allreduce_s)
    a.summary = stats(2.0, None, 10, 0.01, ready=1.0, terms=(1.0, 1.0))
    b.terms = (3.0, 1.0)  # b ran no backward this step: the terms it holds count
    s = hooks.step_summary()
    assert s is not None and s.grad_noise_scale == pytest.approx(2.0)


class LateSummary:
    """A model's statistics still in flight: counts the reads of its figures."""

    def __init__(self, figures: GradientStats | None) -> None:
        self.figures = figures
        self.landed = False
        self.reads = 0

    def ready(self) -> bool:
        return self.landed

    def __getattr__(self, name: str):
        self.reads += 1
        return None if self.figures is None else getattr(self.figures, name)


def test_in_flight_statistics_are_combined_when_read_not_when_taken():
    """On CUDA a model's totals may still be on their way when the step ends: taking the
    step's summary must read none of them (a read waits for the GPU), and the combined
    figures are those of the step whenever they are read."""
    a, b = FakeHook(), FakeHook()
    hooks = pair(a, b)
    late_a = LateSummary(stats(3.0, 10.0, 100, 0.01, ready=5.0, terms=(10.0, 9.0)))
    late_b = LateSummary(None)  # b's step was void: some rank aborted it
    late_b.noise_terms = (2.0, 16.0)  # the terms the void step left as they were
    a.summary, b.summary = late_a, late_b
    s = hooks.step_summary()
    assert s is not None and late_a.reads == late_b.reads == 0
    assert not s.ready()
    late_a.landed = late_b.landed = True
    assert s.ready()
    assert s.grad_norm == pytest.approx(3.0) and s.grad_variance == pytest.approx(10.0)
    assert s.comm_bytes == 100 and s.compression == "none"
    assert s.grad_noise_scale == pytest.approx(12.0 / 25.0)  # b's terms, left by its void step


def test_a_model_whose_last_step_is_in_flight_is_not_waited_for():
    """A model without a backward this step whose previous step's statistics are still in
    flight: its terms come from that step when read, not by waiting now."""
    a, b = FakeHook(), FakeHook()
    hooks = pair(a, b)
    earlier_b = LateSummary(stats(4.0, 2.5, 40, 0.02, ready=7.0, terms=(2.0, 16.0)))
    b.terms = earlier_b  # b's held terms: its step in flight
    a.summary = stats(3.0, 10.0, 100, 0.01, ready=5.0, terms=(10.0, 9.0))
    s = hooks.step_summary()
    assert s is not None and earlier_b.reads == 0 and not s.ready()
    earlier_b.landed = True
    assert s.ready()
    assert s.grad_norm == pytest.approx(3.0)  # b ran no backward this step
    assert s.grad_noise_scale == pytest.approx(12.0 / 25.0)
