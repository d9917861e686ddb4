"""What counts as a step: a `step()` block that finished. A body that raised, a step opened
inside another, and a step after `close()` are not stored as steps. A failed step keeps its
number and its step-boundary hooks (the actuator's and checkpointing's collectives) run when
the next step begins, so a script that goes on stays in step with the other ranks; the
others have none."""

from __future__ import annotations

import logging

import pytest

import trainspec
import trainspec.store as store
from tests.helpers.env import one_process


def _steps(run_dir) -> list[tuple[int, int]]:
    t = store.query(run_dir, "SELECT step, samples FROM steps ORDER BY step")
    return list(zip(t.column("step").to_pylist(), t.column("samples").to_pylist()))


def _events(run_dir) -> list[tuple[str, str, str, str]]:
    t = store.query(run_dir, "SELECT kind, name, severity, reason FROM events ORDER BY ts")
    return [tuple(r.values()) for r in t.to_pylist()]


def _boundaries(ts) -> list[int]:
    seen: list[int] = []
    ts.boundary_hooks.append(seen.append)
    return seen


def test_a_step_whose_body_raised_is_a_fault_event_not_a_step(ts):
    boundaries = _boundaries(ts)
    with ts.step(samples=4):
        pass
    with pytest.raises(ValueError, match="bad batch"), ts.step(samples=8):
        raise ValueError("bad batch")
    assert boundaries == [1]  # not run by a rank on its way out
    with ts.step(samples=16):
        assert boundaries == [1, 2]  # the failed step's boundary, owed, runs as this begins
    assert boundaries == [1, 2, 3]
    ts.collector.flush()
    assert _steps(ts.run_dir) == [(0, 4), (2, 16)]  # the failed step keeps its number
    assert _events(ts.run_dir) == [("fault", "step_failed", "error", "ValueError: bad batch")]


def test_the_scripts_exception_survives_a_failing_event_record(ts, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sink gone")

    monkeypatch.setattr(ts.collector, "record_event", broken)
    with pytest.raises(KeyError, match="the script's"), ts.step(samples=4):
        raise KeyError("the script's")


def test_an_interrupted_step_is_a_warning(ts):
    with pytest.raises(KeyboardInterrupt), ts.step(samples=4):
        raise KeyboardInterrupt
    ts.collector.flush()
    assert _steps(ts.run_dir) == []
    assert _events(ts.run_dir) == [("fault", "step_failed", "warning", "KeyboardInterrupt")]


@pytest.mark.parametrize(("code", "severity"), [(0, "info"), (None, "info"), (3, "warning")])
def test_sys_exit_inside_a_step_is_a_fault_only_when_it_says_so(ts, code, severity):
    """sys.exit(0) inside a step is a clean exit (it was a warning, like an interrupt)."""
    with pytest.raises(SystemExit), ts.step(samples=4):
        raise SystemExit(code)
    ts.collector.flush()
    assert [e[:3] for e in _events(ts.run_dir)] == [("fault", "step_failed", severity)]


def test_a_step_inside_a_step_is_not_recorded_and_warns_once(ts, caplog):
    boundaries = _boundaries(ts)
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        for _ in range(2):
            with ts.step(samples=4), ts.step(samples=100) as inner:
                assert not inner.recorded
    ts.collector.flush()
    assert _steps(ts.run_dir) == [(0, 4), (1, 4)]
    assert boundaries == [1, 2]
    assert sum("inside another step" in r.getMessage() for r in caplog.records) == 1


def test_a_hand_begun_step_never_ended_is_dropped_by_the_next(ts):
    ts.begin_step(samples=3)
    ctx = ts.begin_step(samples=5)
    ts.end_step(ctx)
    ts.end_step(ctx)  # a second end of the same step records nothing
    ts.collector.flush()
    assert _steps(ts.run_dir) == [(0, 5)]


def test_steps_after_close_run_but_are_not_recorded(tmp_path, monkeypatch, caplog):
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path)
    boundaries = _boundaries(ts)
    with ts.step(samples=4):
        pass
    with ts.step(samples=6):
        ts.close()  # closed inside the step: that step is not recorded
    ran = []
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        for _ in range(3):
            with ts.step(samples=8) as s, s.phase("forward"):
                ran.append(s.recorded)
    assert ran == [False, False, False]
    assert boundaries == [1]
    assert ts.step_index == 1
    assert _steps(ts.run_dir) == [(0, 4)]
    assert sum("after close()" in r.getMessage() for r in caplog.records) == 1
