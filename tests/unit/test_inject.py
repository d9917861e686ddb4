from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from trainspec.runtime.inject import (
    Fault,
    FaultPlan,
    InjectionNotAllowedError,
    Injector,
    InjectSpecError,
)

SPEC = "kill:rank=1,step=7;slow:rank=0,factor=2;squeeze:rank=1,bytes=2000000000;spike:step=20;preempt:step=30"


def test_parse_the_documented_example() -> None:
    plan = FaultPlan.parse(SPEC)
    assert plan.faults == [
        Fault("kill", rank=1, step=7, attempt=0),
        Fault("slow", rank=0, factor=2.0),
        Fault("squeeze", rank=1, bytes=2_000_000_000),
        Fault("spike", step=20),
        Fault("preempt", step=30, attempt=0),
    ]


def test_builder_round_trips_through_the_environment() -> None:
    plan = (
        FaultPlan()
        .fail_at(1, 7)
        .slow(0, 2.5, from_step=3)
        .squeeze(1, 10**9)
        .spike_at(20)
        .preempt_at(30)
    )
    env = plan.to_env()
    assert FaultPlan.from_env(env) == plan


def test_health_faults_parse_and_round_trip() -> None:
    plan = FaultPlan.parse("ecc:rank=1,step=12;latency:rank=0,step=20,ms=7.5")
    assert plan.faults == [
        Fault("ecc", rank=1, step=12),
        Fault("latency", rank=0, step=20, ms=7.5),
    ]
    assert FaultPlan.from_env(plan.to_env()) == plan
    injector = Injector(plan, rank=0, attempt=0)
    assert injector.active("latency", 19) == [] and injector.active("latency", 25)


def test_refused_without_opt_in() -> None:
    with pytest.raises(InjectionNotAllowedError, match="TRAINSPEC_ALLOW_INJECT=1"):
        FaultPlan.from_env({"TRAINSPEC_INJECT": "kill:rank=0,step=1"})
    assert FaultPlan.from_env({}).faults == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("explode:rank=1", "unknown fault kind"),
        ("kill:rank=1", "lacks"),
        ("kill:rank=1,step=x", "not a number"),
        ("kill:rank=1,step=2,colour=3", "bad field"),
        ("kill:rank=1.5,step=2", "non-negative integer"),
        ("slow:rank=0,factor=0.5", "factor must be >= 1"),
        ("ecc:rank=1", "lacks"),
        ("latency:rank=1,step=3", "lacks"),
        ("latency:rank=1,step=3,ms=0", "latency ms must be a positive number"),
        ("latency:rank=1,step=3,ms=inf", "latency ms must be a positive number"),
    ],
)
def test_bad_specs_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InjectSpecError, match=message):
        FaultPlan.parse(text)


def test_kill_only_applies_to_its_rank_and_first_attempt() -> None:
    plan = FaultPlan().fail_at(1, 7)
    assert Injector(plan, rank=1, attempt=0).faults_at("kill", 7)
    assert not Injector(plan, rank=0, attempt=0).faults_at("kill", 7)
    assert not Injector(plan, rank=1, attempt=1).faults_at("kill", 7)
    assert not Injector(plan, rank=1, attempt=0).faults_at("kill", 6)


def test_slow_sleeps_in_proportion_to_compute() -> None:
    inj = Injector(FaultPlan().slow(0, 3.0, from_step=2), rank=0, attempt=0)
    assert inj.after_compute(1, 0.05) == 0.0
    start = time.perf_counter()
    delay = inj.after_compute(2, 0.05)
    assert delay == pytest.approx(0.10)
    assert time.perf_counter() - start >= 0.095
    assert Injector(FaultPlan().slow(0, 3.0), rank=1, attempt=0).after_compute(5, 0.05) == 0.0


def test_kill_really_kills_the_process() -> None:
    code = (
        "from trainspec.runtime.inject import FaultPlan, Injector\n"
        "inj = Injector(FaultPlan().fail_at(0, 3), rank=0, attempt=0)\n"
        "for step in range(10):\n"
        "    inj.at_step_start(step)\n"
        "    print(step, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1", "2"]


def test_squeeze_reports_pressure_from_its_step_on() -> None:
    plan = FaultPlan.parse("squeeze:rank=1,step=5;squeeze:rank=0,pressure=0.95,step=2")
    assert plan.faults[0] == Fault("squeeze", rank=1, step=5)
    inj = Injector(plan, rank=1, attempt=0)
    assert inj.squeezed_pressure(4, 0.3, 1e9) == 0.3
    assert inj.squeezed_pressure(5, 0.3, 1e9) == 0.99 == inj.squeezed_pressure(40, 0.3, 1e9)
    assert Injector(plan, rank=0, attempt=0).squeezed_pressure(3, 0.3, 1e9) == 0.95
    by_bytes = Injector(FaultPlan().squeeze(0, 4 * 10**8), rank=0, attempt=0)
    assert by_bytes.squeezed_pressure(0, 0.3, 1e9) == pytest.approx(0.7)  # 0.3 + 0.4e9 / 1e9
    assert FaultPlan.from_env(FaultPlan().squeeze(1, step=3, pressure=0.97).to_env()).faults == [
        Fault("squeeze", rank=1, step=3, pressure=0.97)
    ]


def test_oom_raises_torch_out_of_memory_above_its_micro_batch() -> None:
    import torch

    plan = FaultPlan.parse("oom:rank=1,step=12,max_micro=4")
    assert plan == FaultPlan().oom(1, 4, from_step=12)
    inj = Injector(plan, rank=1, attempt=0)
    inj.check_micro_batch(11, 8)  # before its step: fits
    inj.check_micro_batch(12, 4)  # small enough: fits
    with pytest.raises(torch.OutOfMemoryError, match="injected out of memory"):
        inj.check_micro_batch(30, 5)
    Injector(plan, rank=0, attempt=0).check_micro_batch(30, 64)  # another rank: fits


@pytest.mark.parametrize(
    "text, message",
    [
        ("squeeze:rank=1,pressure=1.5", "pressure must be in"),
        ("oom:rank=1,max_micro=0", "max_micro must be at least 1"),
        ("oom:rank=1", "lacks"),
        ("squeeze:step=3", "lacks"),
    ],
)
def test_bad_memory_faults_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InjectSpecError, match=message):
        FaultPlan.parse(text)
