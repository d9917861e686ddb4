"""The zero-code layer at an exception the script does not catch (`sys.excepthook`): the
step it ran in failed, a `step_failed` fault as in the explicit API's `step()` block."""

from __future__ import annotations

import pytest
import torch

import trainspec.store as store
from trainspec.runtime.auto import AutoInstrumentation, _excepthook


def train(auto: AutoInstrumentation, *, step: bool = True) -> None:
    auto.on_batch(torch.zeros(8, 3), 0.0, "loader")
    auto.on_forward_start(((torch.zeros(8, 3),), {}))
    auto.on_forward_end()
    auto.on_backward_start()
    auto.on_backward_end()
    if step:
        auto.on_optimizer_pre("opt")
        auto.on_optimizer_post("opt")


def stored(auto: AutoInstrumentation) -> tuple[list[int], list[tuple]]:
    auto._finish_step()  # as the layer's atexit handler
    auto.session.collector.flush()
    run = auto.session.run_dir
    steps = [
        r["step"] for r in store.query(run, "SELECT step FROM steps ORDER BY step").to_pylist()
    ]
    sql = "SELECT step, kind, name, severity, reason FROM events ORDER BY ts"
    return steps, [tuple(r.values()) for r in store.query(run, sql).to_pylist()]


@pytest.mark.parametrize("stepped", [False, True])
def test_an_uncaught_exception_fails_the_step_it_ran_in(auto, stepped):
    """Raised after the step's backward (`stepped=False`: its optimizer never ran), or after
    its optimizer step (that step is over and stored; the next one, begun as it ended,
    failed). No event was stored: `validate --strict` failed on the rank's lost step."""
    for _ in range(3):
        train(auto)
    train(auto, step=stepped)
    auto.on_uncaught(RuntimeError("boom"))
    steps, events = stored(auto)
    failed = 4 if stepped else 3
    assert steps == list(range(failed))
    assert events == [(failed, "fault", "step_failed", "error", "RuntimeError: boom")]


def test_an_exception_inside_a_first_optimizer_step_fails_that_step(auto):
    """The optimizer raised in its step: it never stepped, though another did."""
    train(auto)
    train(auto, step=False)
    auto.on_optimizer_pre("opt")
    auto.on_optimizer_post("opt")
    auto.on_optimizer_pre("second")  # raises inside: no post hook
    auto.on_uncaught(ValueError("bad"))
    steps, events = stored(auto)
    assert steps == [0] and [e[:3] for e in events] == [(1, "fault", "step_failed")]


def test_a_script_that_measures_itself_records_its_own_failures(auto):
    auto.explicit = True  # `trainspec.init()` in the script: its step() blocks record
    train(auto)
    auto.on_uncaught(RuntimeError("boom"))
    assert stored(auto)[1] == []


def test_the_excepthook_tells_the_layer_then_the_hook_it_replaces(auto, monkeypatch):
    """The script's traceback is printed as before, after the failure is recorded; a
    failure to record it is contained."""
    printed: list[BaseException] = []
    hook = _excepthook(auto, lambda kind, exc, tb: printed.append(exc))
    train(auto, step=False)
    exc = RuntimeError("boom")
    hook(RuntimeError, exc, None)
    assert printed == [exc]
    assert [e[:3] for e in stored(auto)[1]] == [(0, "fault", "step_failed")]

    def broken(exc: BaseException) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(auto, "on_uncaught", broken)
    hook(RuntimeError, exc, None)
    assert printed == [exc, exc] and auto.failures == 1
