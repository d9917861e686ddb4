"""The memory policy on synthetic summaries, and the controller applying it (scripted gather)."""

from __future__ import annotations

from tests.unit.test_actuator_controller import Peer, RecordingHook, cfg, run_steps
from trainspec.actuator import Controller, Targets
from trainspec.actuator.memory_policy import MemoryPolicy, smallest_limit
from trainspec.actuator.micro_batch import WHOLE_SHARE, MicroBatchPlan
from trainspec.actuator.summary import RankSummary
from trainspec.data import ShareBatchSampler


def window(limits=(0, 0), shares=(8, 8), pressure=(0.5, 0.5), oom=(0, 0)) -> list[RankSummary]:
    return [
        RankSummary(rank=r, steps=5, samples=5 * n, share=n, micro_batch=m,
                    memory_pressure=p, oom_micro_batch=o)
        for r, (m, n, p, o) in enumerate(zip(limits, shares, pressure, oom))
    ]  # fmt: skip


def test_pressure_halves_then_again_while_it_lasts_never_below_the_minimum():
    pol = MemoryPolicy(WHOLE_SHARE, minimum=2, patience=1, cooldown=1)
    high = dict(pressure=(0.5, 0.97))
    first = pol.decide(window(**high), entered=True, active=True, pressed=True, ranks=(1,))
    assert first.kind == "memory" and first.ranks == (1,)
    assert first.before == {"limit": 0, "micro_batch": [8, 8], "accumulation_steps": [1, 1]}
    assert first.after == {"limit": 4, "micro_batch": [4, 4], "accumulation_steps": [2, 2]}
    assert "shares unchanged: [8, 8]" in first.reason
    # still pressed: the next halving waits patience + cooldown windows
    assert pol.decide(window((4, 4), **high), entered=False, active=True, pressed=True) is None
    second = pol.decide(window((4, 4), **high), entered=False, active=True, pressed=True)
    assert second.after["limit"] == 2
    for _ in range(4):  # at the minimum: nothing more to do
        assert pol.decide(window((2, 2), **high), entered=False, active=True, pressed=True) is None


def test_grows_back_only_after_clear_windows_plus_cooldown_up_to_the_configured_size():
    pol = MemoryPolicy(WHOLE_SHARE, minimum=1, patience=2, cooldown=2)
    pol.decide(window(), entered=True, active=True, pressed=True)  # -> 4
    decisions = []
    for _ in range(8):  # the detector has left pressure (after its own patience windows)
        a = pol.decide(window((4, 4) if not decisions else (decisions[-1],) * 2),
                       entered=False, active=False, pressed=False)  # fmt: skip
        if a is not None:
            decisions.append(a.after["limit"])
    assert decisions == [WHOLE_SHARE]  # 4 -> 8 is the whole share: no accumulation again
    pol = MemoryPolicy(8, minimum=1, patience=1, cooldown=0)
    pol.decide(window((8, 8), shares=(16, 16)), entered=True, active=True, pressed=True)
    grown = pol.decide(window((4, 4), shares=(16, 16)), entered=False, active=False, pressed=False)
    assert grown.after["limit"] == 8  # capped at the configured size, not the share
    assert pol.decide(window((8, 8), shares=(16, 16)), entered=False, active=False,
                      pressed=False) is None  # fmt: skip


def test_no_growth_while_the_detector_is_still_in_pressure():
    pol = MemoryPolicy(WHOLE_SHARE, minimum=1, patience=1, cooldown=0)
    pol.decide(window(), entered=True, active=True, pressed=True)
    for _ in range(5):  # between the exit and enter thresholds: still active, not pressed
        assert pol.decide(window((4, 4)), entered=False, active=True, pressed=False) is None


def test_ranks_that_differ_after_an_oom_retry_reconcile_to_the_smallest():
    pol = MemoryPolicy(WHOLE_SHARE, minimum=1, patience=3, cooldown=2)
    a = pol.decide(window((0, 4), oom=(0, 8)), entered=False, active=False, pressed=False)
    assert a.after["limit"] == 4 and a.before["micro_batch"] == [8, 4]
    assert "rank [1] shrank after an out-of-memory retry" in a.reason
    assert smallest_limit([0, 4, 2]) == 2 and smallest_limit([0, 0]) == WHOLE_SHARE
    # and never grows back to the size that ran out of memory
    for _ in range(10):
        assert pol.decide(window((4, 4)), entered=False, active=False, pressed=False) is None


def probe(pressure: float):
    return lambda: (pressure, 0.0)


def memory_controller(pressure: float, **kw):
    """Rank 0 of two; the scripted peer reports what this rank does (same pressure, plan)."""
    peer = Peer(per_sample_s=0.01)
    peer.version = -1  # the peer applies what this rank applies
    sampler = ShareBatchSampler(1000, 16, rank=0, world_size=2)
    plan = MicroBatchPlan(WHOLE_SHARE)
    targets = Targets(rank=0, global_batch=16, sampler=sampler, hook=RecordingHook(),
                      micro_batch=plan)  # fmt: skip
    events: list[tuple] = []
    ctl = Controller(
        cfg(window_steps=5, rebalance=False, **kw), world_size=2, group=None, targets=targets,
        emit=lambda kind, name, reason, **k: events.append((kind, name, reason, k)),
        memory_probe=probe(pressure), gather=peer,
    )  # fmt: skip
    return ctl, sampler, plan, events


def test_the_controller_shrinks_the_plan_under_pressure_and_records_it():
    ctl, sampler, plan, events = memory_controller(0.97)
    run_steps(ctl, sampler, 5)
    assert plan.limit == WHOLE_SHARE  # patience 2: one window is not yet pressure
    run_steps(ctl, sampler, 6, start=5)  # the second window is decided a step after it ends
    assert plan.limit == 4 and sampler.shares == (8, 8) and ctl.plan_version == 1
    ((kind, name, reason, kw),) = [e for e in events if e[1] == "memory"]
    assert kind == "action" and kw["after"]["limit"] == 4 and kw["before"]["limit"] == 0
    assert not any(e[1] == "advice" for e in events)  # acted on, not advised


def test_dry_run_records_the_memory_action_and_changes_nothing():
    ctl, sampler, plan, events = memory_controller(0.97, dry_run=True)
    run_steps(ctl, sampler, 11)
    assert plan.limit == WHOLE_SHARE and ctl.plan_version == 0
    memory = [e for e in events if e[1] == "memory"]
    assert memory and memory[0][2].startswith("dry run, not applied")


def test_memory_pressure_is_advised_when_the_policy_is_off():
    ctl, sampler, plan, events = memory_controller(0.97, memory=False)
    assert ctl.memory_policy is None
    run_steps(ctl, sampler, 11)
    assert plan.limit == WHOLE_SHARE
    assert any(e[1] == "advice" and "smaller micro-batch" in e[2] for e in events)
