"""The controller on one rank with a scripted control plane: windows, dry run, failures.

The gather is the controller's seam (`gather=`): here it returns this rank's summary beside
a scripted peer's, as the all-gather would. The real all-gather runs in the torchrun tests.
A window's gather is launched at its boundary and decided on at the next step's boundary,
so a decision for the window ending at step k lands at step k + 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trainspec.actuator import FLAG_PREEMPT, Controller, Targets
from trainspec.actuator.checkpointing import CheckpointPolicy
from trainspec.actuator.gather import GatherError
from trainspec.actuator.summary import RankSummary
from trainspec.collector.records import StepRecord
from trainspec.config import ActuatorConfig
from trainspec.data import ShareBatchSampler


class RecordingHook:
    """The part of the kernels' CompressionHook the actuator drives, recording the calls."""

    def __init__(self) -> None:
        self.level, self.step, self.calls = "none", 0, []

    def set_shares(self, local: int, total: int) -> None:
        self.calls.append(("set_shares", local, total))

    def set_level(self, level: str, at_step: int | None = None) -> None:
        self.calls.append(("set_level", level, at_step))


class Peer:
    """Rank 1 of a two-rank job, 2x slower per sample; the gather returns both summaries."""

    def __init__(self, per_sample_s: float = 0.02, fail_at: int | None = None) -> None:
        self.per_sample_s, self.fail_at, self.calls, self.version = per_sample_s, fail_at, 0, 0

    def __call__(self, mine: RankSummary, group: object) -> Callable[[], list[RankSummary]]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise GatherError("control all-gather failed: timed out")
        peer = RankSummary.from_list(mine.to_list())
        peer.rank, peer.compute_s = 1, self.per_sample_s * mine.samples
        peer.step_compute_median_s = peer.compute_s / mine.steps
        peer.plan_version = self.version if self.version >= 0 else mine.plan_version
        return lambda: [mine, peer]


def make(config: ActuatorConfig, peer: Peer):
    sampler = ShareBatchSampler(1000, 16, rank=0, world_size=2)
    hook = RecordingHook()
    events: list[tuple] = []

    def emit(kind, name, reason, **kw):
        events.append((kind, name, reason, kw))

    targets = Targets(rank=0, global_batch=16, sampler=sampler, hook=hook)
    ctl = Controller(config, world_size=2, group=None, targets=targets, emit=emit, gather=peer)
    return ctl, sampler, hook, events


def run_steps(ctl: Controller, sampler: ShareBatchSampler, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        n = sampler.shares[0]
        ctl.on_record(StepRecord(ts=0, rank=0, step=step, duration_s=0.1, forward_s=0.01 * n / 3,
                                 backward_s=0.02 * n / 3, samples=n, loss=2.0))  # fmt: skip
        ctl.on_boundary(step + 1)


def cfg(**kw) -> ActuatorConfig:
    return ActuatorConfig(compression=False, checkpoint=False, patience=2, **kw)


def test_rebalances_at_a_window_boundary_on_sampler_and_hook_alike():
    peer = Peer()
    peer.version = -1  # the peer applies what this rank applies
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    run_steps(ctl, sampler, 10)
    assert sampler.shares == (8, 8) and peer.calls == 2  # one window decided: patience 2
    run_steps(ctl, sampler, 1, start=10)  # the second window is decided a step after it ends
    assert sampler.shares == (11, 5) and hook.calls == [("set_shares", 11, 16)]
    kinds = [(e[0], e[1]) for e in events]
    assert ("anomaly", "straggler") in kinds and ("action", "rebalance") in kinds
    action = next(e for e in events if e[1] == "rebalance")
    assert action[3]["before"] == {"shares": [8, 8]} and action[3]["after"] == {"shares": [11, 5]}
    assert ctl.plan_version == 1 and ctl.cost.windows == 2 and ctl.cost.per_step_s > 0


def test_dry_run_advises_and_changes_nothing():
    ctl, sampler, hook, events = make(cfg(window_steps=5, dry_run=True), Peer())
    run_steps(ctl, sampler, 30)
    assert sampler.shares == (8, 8) and hook.calls == [] and ctl.plan_version == 0
    advised = [e for e in events if e[1] == "rebalance"]
    assert advised and all(e[2].startswith("dry run, not applied") for e in advised)
    assert all(not h["applied"] for h in ctl.history)


def test_a_failed_gather_stops_the_controller_and_applies_nothing():
    ctl, sampler, hook, events = make(cfg(window_steps=5), Peer(fail_at=2))
    run_steps(ctl, sampler, 30)
    assert ctl.stopped and "timed out" in ctl.stopped
    assert sampler.shares == (8, 8) and hook.calls == []
    assert [e[1] for e in events if e[0] == "anomaly"][-1] == "control_plane"


def test_ranks_that_disagree_on_the_plan_stop_together():
    peer = Peer()
    peer.version = 0  # the peer never applied the rebalance this rank applied
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    run_steps(ctl, sampler, 16)
    assert ctl.stopped and "disagree" in ctl.stopped
    # This rank had moved to uneven shares, the peer had not: both back to the equal split
    # (it stayed on its own, some samples trained twice, others skipped, to the run's end).
    assert hook.calls[0][0] == "set_shares" and hook.calls[0][1] != 8
    assert sampler.shares == (8, 8) and hook.calls[-1] == ("set_shares", 8, 16)
    assert "shares back to equal on every rank" in ctl.stopped


def test_healthy_peer_triggers_nothing():
    ctl, sampler, hook, events = make(cfg(window_steps=5), Peer(per_sample_s=0.01))
    run_steps(ctl, sampler, 50)
    assert events == [] or all(e[1] == "gradient_regime" for e in events)
    assert sampler.shares == (8, 8) and not math.isnan(ctl.cost.per_step_s)


def test_advice_only_when_nothing_can_apply_it():
    peer = Peer()
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    ctl.targets.sampler = None  # no share sampler: a rebalance can only be advised
    run_steps(ctl, sampler, 11)
    assert sampler.shares == (8, 8)
    assert any("no target to apply it to" in e[2] for e in events)


def test_a_preemption_flag_on_any_rank_checkpoints_at_the_next_window():
    saved: list[tuple[int, str]] = []
    peer = Peer(per_sample_s=0.01)
    peer.version = -1  # the peer applies what this rank applies
    ctl, sampler, hook, events = make(
        ActuatorConfig(compression=False, rebalance=False, patience=2, window_steps=5), peer
    )
    ctl.targets.checkpoint = lambda step, reason: saved.append((step, reason)) or 0.5
    ctl.checkpointing = CheckpointPolicy(lambda cost, step_s: 10**6)
    run_steps(ctl, sampler, 6)  # first window, decided at step 6: the cost-measuring checkpoint
    ctl.raise_flag(FLAG_PREEMPT)
    run_steps(ctl, sampler, 5, start=6)
    assert [s for s, _ in saved] == [6, 11] and "preemption" in saved[1][1]
    assert ctl.targets.checkpoint_cost_s == 0.5


class RecordingPeer(Peer):
    """A Peer that records when each gather is launched (with the window's step count) and
    when it is waited on."""

    def __init__(self) -> None:
        super().__init__()
        self.version = -1
        self.log: list[tuple[str, int]] = []
        self.launched: list[RankSummary] = []

    def __call__(self, mine: RankSummary, group: object) -> Callable[[], list[RankSummary]]:
        result = super().__call__(mine, group)
        self.log.append(("launch", mine.steps))
        self.launched.append(mine)

        def wait() -> list[RankSummary]:
            self.log.append(("wait", mine.steps))
            return result()

        return wait


def test_the_gather_runs_beside_a_step_and_the_old_plans_step_is_left_out():
    peer = RecordingPeer()
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    run_steps(ctl, sampler, 5)
    assert peer.log == [("launch", 5)]  # launched at the window's boundary, not waited on
    run_steps(ctl, sampler, 1, start=5)
    assert peer.log == [("launch", 5), ("wait", 5)]  # read at the next step's boundary
    run_steps(ctl, sampler, 9, start=6)  # the second window's decision moves shares at 11
    assert sampler.shares == (11, 5) and ctl.plan_version == 1
    # the window ending at 15 lost step 11, which ran under the old shares
    assert peer.log[-1] == ("launch", 4)
    ctl.close()  # waits for the gather still in flight
    assert peer.log[-1] == ("wait", 4)


def test_records_that_arrive_late_are_left_out_by_step_number():
    """On CUDA a step's record comes once its events are done, a boundary or more late: the
    steps that ran under the old shares must not reach the new window, late or not."""
    peer = RecordingPeer()
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    late: StepRecord | None = None
    for step in range(15):
        n = sampler.shares[0]
        if late is not None:
            ctl.on_record(late)  # the previous step's record, one boundary late
        late = StepRecord(ts=0, rank=0, step=step, duration_s=0.1, forward_s=0.01 * n / 3,
                          backward_s=0.02 * n / 3, samples=n, loss=2.0)  # fmt: skip
        ctl.on_boundary(step + 1)
    assert sampler.shares == (11, 5)  # decided at 11: steps 11 onward run at 11 samples
    window = peer.launched[-1]  # launched at 15, holding the records delivered so far
    assert window.steps == 3 and window.samples == 3 * 11  # steps 11-13; 9 and 10 left out


def test_flags_of_a_window_that_could_not_be_decided_reach_the_next():
    peer = RecordingPeer()
    ctl, sampler, hook, events = make(cfg(window_steps=5), peer)
    ctl.raise_flag(FLAG_PREEMPT)
    run_steps(ctl, sampler, 5)  # launched with the flag
    ctl.paused = True  # an operator's pause lands while that gather is in flight
    run_steps(ctl, sampler, 1, start=5)
    ctl.paused = False
    run_steps(ctl, sampler, 4, start=6)
    assert peer.launched[-1].flags & FLAG_PREEMPT


def test_a_share_floor_the_batch_cannot_hold_switches_rebalancing_off_not_the_job(caplog):
    # 2 ranks x min_share 9 > the script's global batch of 16: no plan could keep the floor.
    ctl, sampler, hook, events = make(cfg(min_share=9), Peer())
    assert ctl.rebalance is None
    assert [(e[0], e[1]) for e in events] == [("anomaly", "config")]
    assert "min_share 9 x 2 ranks exceeds the global batch 16" in events[0][2]
    assert "rebalancing off" in caplog.text
    run_steps(ctl, sampler, 12)  # the rest of the loop runs; shares stay equal
    assert sampler.shares == (8, 8) and not [c for c in hook.calls if c[0] == "set_shares"]
    ctl_ok, *_ = make(cfg(min_share=8), Peer())
    assert ctl_ok.rebalance is not None
    seen: list[tuple] = []  # rank 1 warns too, but the event is rank 0's to record
    targets = Targets(rank=1, global_batch=16, hook=RecordingHook(),
                      sampler=ShareBatchSampler(1000, 16, rank=1, world_size=2))  # fmt: skip
    ctl1 = Controller(cfg(min_share=9), world_size=2, group=None, targets=targets,
                      emit=lambda *a, **k: seen.append(a), gather=Peer())  # fmt: skip
    assert ctl1.rebalance is None and seen == []


class LinePeer:
    """Rank 1 on its share of the sampler, a step of 15 ms + 2 ms a sample x its slowdown."""

    def __init__(self, sampler: ShareBatchSampler, slowdown: float = 1.0) -> None:
        self.sampler, self.slowdown = sampler, slowdown

    def __call__(self, mine: RankSummary, group: object) -> Callable[[], list[RankSummary]]:
        n = self.sampler.shares[1]
        per_step = (0.015 + 0.002 * n) * self.slowdown
        peer = RankSummary.from_list(mine.to_list())
        peer.rank, peer.samples, peer.share = 1, n * mine.steps, n
        peer.compute_s, peer.step_compute_median_s = per_step * mine.steps, per_step
        return lambda: [mine, peer]


def straggler_events(shares: list[int], slowdown: float, windows: int = 8) -> list[tuple]:
    """Straggler anomalies of a controller over shares restored uneven, rank 0 at 15 ms + 2 ms
    a sample, rank 1 `slowdown` x that: (step, ranks, cleared)."""
    sampler = ShareBatchSampler(10_000, 32, rank=0, world_size=2)
    sampler.set_shares(shares)
    events: list[tuple] = []

    def emit(kind, name, reason, **kw):
        if (kind, name) == ("anomaly", "straggler"):
            events.append((step + 1, kw["evidence"]["ranks"], reason.startswith("cleared")))

    targets = Targets(rank=0, global_batch=32, sampler=sampler, hook=RecordingHook())
    ctl = Controller(cfg(window_steps=5), world_size=2, group=None, targets=targets, emit=emit,
                     gather=LinePeer(sampler, slowdown))  # fmt: skip
    for step in range(windows * 5):
        c = 0.015 + 0.002 * sampler.shares[0]
        ctl.on_record(StepRecord(ts=0, rank=0, step=step, duration_s=c + 0.01, forward_s=c / 3,
                                 backward_s=2 * c / 3, samples=sampler.shares[0], loss=2.0))  # fmt: skip
        ctl.on_boundary(step + 1)
    return events


def test_equal_ranks_on_restored_uneven_shares_raise_no_straggler():
    # Per sample the rank on 10 samples looked 1.3x slower (3.5 ms against 2.7 ms): its
    # fixed cost over fewer samples. Before, a straggler at step 11 and a back-off after.
    assert straggler_events([10, 22], 1.0) == []
    assert straggler_events([8, 24], 1.0) == []


def test_a_slow_rank_on_a_restored_small_share_is_still_a_straggler():
    # 1.5x slower on 10 of 32: 52.5 ms a step against 59 ms, points an equal pair's line
    # with a 47 ms fixed cost would fit too; at most half a step is taken out.
    assert straggler_events([22, 10], 1.5) == [(11, [1], False)]
