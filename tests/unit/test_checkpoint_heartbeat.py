"""Heartbeat and PreemptionWatcher on a one-rank gloo group (the two-rank cases are integration)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainspec.runtime.heartbeat import Heartbeat, PreemptionWatcher

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]


def test_no_progress_is_reported_once_and_progress_clears_it() -> None:
    events: list[tuple[str, str, dict]] = []
    hb = Heartbeat(
        interval_s=0.05, timeout_s=5, stall_timeout_s=0.3, on_event=lambda *e: events.append(e)
    )
    hb.start()
    hb.progress(4)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(events) == 1
    kind, cause, evidence = events[0]
    assert (kind, cause, evidence["rank"], evidence["step"]) == ("fault", "no progress", 0, 4)
    assert evidence["idle_s"] >= 0.3
    hb.progress(5)
    time.sleep(0.2)
    assert hb.beats > 3 and hb.faults == [(0, "no progress")]
    hb.stop()


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"timeout_s": -1}, {"stall_timeout_s": 0}])
def test_bad_intervals_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Heartbeat(**kwargs)


def test_sigterm_becomes_an_agreed_stop_and_close_restores_the_handler() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    watcher = PreemptionWatcher(timeout_s=10, grace_s=600)
    try:
        assert watcher.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert watcher.should_stop() is True and watcher.signal_received == signal.SIGTERM
        deadline = watcher._deadline
        assert deadline is not None and deadline.is_alive()
    finally:
        watcher.close()
        watcher.close()  # a second close does nothing
    assert signal.getsignal(signal.SIGTERM) is previous
    assert not deadline.is_alive()


def test_a_clean_stop_at_a_boundary_disarms_the_exit_deadline() -> None:
    """Once the loop reached a boundary and agreed to stop, the exit deadline is off: it had
    killed the process (exit 143) 20 s later, in whatever the script did after its loop."""
    from trainspec.data import ShareBatchSampler
    from trainspec.runtime.actuation import Actuation
    from trainspec.runtime.inject import FaultPlan, Injector

    previous = signal.getsignal(signal.SIGTERM)
    watcher = PreemptionWatcher(timeout_s=10, grace_s=600)
    act = Actuation(ShareBatchSampler(10, 2, rank=0, world_size=1), Injector(FaultPlan([]), rank=0),
                    None, 0, preemption=watcher)  # fmt: skip
    assert act.should_stop(3) is False
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    deadline = watcher._deadline
    assert deadline is not None and deadline.is_alive()
    assert act.should_stop(4) is True
    assert not deadline.is_alive()
    act.close()
    act.close()  # idempotent; SIGTERM is the script's again
    assert signal.getsignal(signal.SIGTERM) is previous


def test_actuate_checkpoints_under_the_configured_dir_and_keeps_the_configured_count(tmp_path):
    """checkpoint.keep_last and checkpoint.dir were printed by `trainspec config` and checked,
    but actuate() hard-coded keep_last=2 and ignored the dir: older checkpoints were deleted."""
    from types import SimpleNamespace

    import torch

    from trainspec.config import load_config
    from trainspec.runtime.actuation import attach
    from trainspec.runtime.groups import SideGroups
    from trainspec.runtime.identity import RankIdentity

    config = load_config(
        overrides={"checkpoint": {"dir": str(tmp_path / "ck"), "keep_last": 5},
                   "actuator": {"enabled": False}},
        environ={},
    )  # fmt: skip
    session = SimpleNamespace(
        identity=RankIdentity(0, 0, 1, "host"), config=config, hook=None,
        groups=SideGroups(probe=None, control=None), operator_actions=False,
        event=lambda *a, **k: None, boundary_hooks=[], record_listeners=[],
    )  # fmt: skip
    model = torch.nn.Linear(4, 2)
    act = attach(session, dataset_len=40, global_batch=8, model=model,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    try:
        assert act.checkpointer.root == tmp_path / "ck" and act.checkpointer.keep_last == 5
        for step in range(7):
            act.save_checkpoint(step, "test")
        act.checkpointer.wait()
    finally:
        act.close()
    assert len(list((tmp_path / "ck").glob("step_*"))) == 5
