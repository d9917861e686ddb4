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


def test_a_memory_action_at_a_rebalance_boundary_is_planned_on_the_new_shares():
    """QA bug 3: at the boundary where [8, 8] became [11, 5] the memory event said "shares
    unchanged: [8, 8]" and 2 + 2 accumulation steps; the ranks ran 4 + 4 + 3 and 3 + 2."""
    peer = Peer()  # 2x slower per sample: rebalanced to [11, 5] at step 11
    peer.version = -1
    sampler = ShareBatchSampler(1000, 16, rank=0, world_size=2)
    plan = MicroBatchPlan(WHOLE_SHARE)
    targets = Targets(rank=0, global_batch=16, sampler=sampler, hook=RecordingHook(),
                      micro_batch=plan)  # fmt: skip
    events: list[tuple] = []
    ctl = Controller(
        cfg(window_steps=5), world_size=2, group=None, targets=targets,
        emit=lambda kind, name, reason, **k: events.append((kind, name, reason, k)),
        memory_probe=probe(0.97), gather=peer,
    )  # fmt: skip
    run_steps(ctl, sampler, 11)
    rebalance = [e for e in events if e[1] == "rebalance"]
    ((_, _, reason, kw),) = [e for e in events if e[1] == "memory"]
    assert rebalance and rebalance[0][3]["after"] == {"shares": [11, 5]}
    assert sampler.shares == (11, 5) and plan.limit == 4
    # halved from the 8 that ran under pressure, recorded on what the ranks now run
    assert kw["before"] == {"limit": 0, "micro_batch": [8, 8], "accumulation_steps": [1, 1]}
    assert kw["after"] == {"limit": 4, "micro_batch": [4, 3], "accumulation_steps": [3, 2]}
    ran = [[mb.size for mb in plan.split(n)] for n in sampler.shares]
    assert ran == [[4, 4, 3], [3, 2]]
    assert [max(r) for r in ran] == kw["after"]["micro_batch"]
    assert [len(r) for r in ran] == kw["after"]["accumulation_steps"]
    assert "[11, 5]" in reason and "unchanged: [8, 8]" not in reason
    assert kw["evidence"]["shares"] == [11, 5] and kw["evidence"]["shares_before"] == [8, 8]


def test_pressure_halves_the_largest_micro_batch_that_ran():
    """An even split runs 6 as 3 + 3 under a limit of 4: the micro-batch that was under
    pressure was 3, halved rounding up to 2 (2 + 2 + 2; rounding down ran six passes of 1)."""
    pol = MemoryPolicy(WHOLE_SHARE, minimum=1, patience=1, cooldown=0)
    a = pol.decide(window((4, 4), shares=(6, 6)), entered=True, active=True, pressed=True)
    assert a.before["micro_batch"] == [3, 3] and a.after["limit"] == 2
    assert "micro-batch 3" in a.reason


def test_after_an_oom_the_limit_stays_below_it_whatever_later_rebalances_do():
    """QA bug 4: OOM at 12 -> limit 6; shares [10, 6]; the limit grew back to the whole
    share (10 < 12) and a rebalance to [13, 3] then ran 13 in one micro-batch."""
    plan = MicroBatchPlan(WHOLE_SHARE, 1)
    pol = MemoryPolicy(WHOLE_SHARE, 1, patience=3, cooldown=2)
    plan.shrink_after_oom(12)
    a = pol.decide(window((6, 0), shares=(12, 4), oom=(12, 0)), entered=False, active=False,
                   pressed=False)  # fmt: skip
    plan.set_limit(a.after["limit"])
    grown = []
    for _ in range(12):  # rebalanced to [10, 6], pressure long clear
        a = pol.decide(window((plan.limit,) * 2, shares=(10, 6), oom=(12, 0)), entered=False,
                       active=False, pressed=False)  # fmt: skip
        if a is not None:
            grown.append(a.after["limit"])
            plan.set_limit(a.after["limit"])
    assert grown == [10]  # as far as the largest share, but a number: never the whole share
    for shares in ((13, 3), (16, 0), (12, 4)):  # later rebalances
        for n in shares:
            assert all(mb.size < 12 for mb in plan.split(n)), (shares, plan.limit)
    # the plan's own floor: a limit that says more (the whole share, restored from an
    # older checkpoint) still runs below the size that ran out of memory on this rank
    plan.set_limit(WHOLE_SHARE)
    assert [mb.size for mb in plan.split(13)] == [7, 6]
    assert [mb.size for mb in plan.split(11)] == [11]
    plan.set_limit(16)
    assert max(mb.size for mb in plan.split(16)) < 12
