"""A step whose gradients are not finite (a loss-scaling overflow, a diverging step) has no
gradient statistics, and an anomaly event on each says why (a warning at the first of a run): an inf norm was
stored, and the run failed the validator's `finite` rule for a normal mixed-precision skip."""

from __future__ import annotations

import math

import trainspec.store as store
from trainspec.collector.gradients import GradientSummary
from trainspec.store.compliance import validate_target


class _Norms:
    def __init__(self, norms: list[float]) -> None:
        self._norms = iter(norms)

    def step_summary(self) -> GradientSummary:
        return GradientSummary(grad_norm=next(self._norms), grad_variance=1.0)


def test_nonfinite_steps_lose_their_statistics_and_are_marked_by_an_event(ts):
    norms = [1.0, math.inf, math.nan, 2.0, math.inf, 3.0]
    ts.grad_source = _Norms(norms)
    for _ in norms:
        with ts.step(samples=4):
            pass
    ts.collector.flush()
    rows = store.query(ts.run_dir, "SELECT grad_norm, grad_variance FROM steps ORDER BY step")
    assert rows.column("grad_norm").to_pylist() == [1.0, None, None, 2.0, None, 3.0]
    assert rows.column("grad_variance").to_pylist() == [1.0, None, None, 1.0, None, 1.0]
    events = store.query(
        ts.run_dir,
        "SELECT step, severity FROM events WHERE name = 'nonfinite_gradients' ORDER BY step",
    )
    assert events.column("step").to_pylist() == [1, 2, 4]
    assert events.column("severity").to_pylist() == ["warning", "info", "warning"]


def test_a_nonfinite_loss_is_stored_as_no_value_with_an_event_and_seen_by_listeners(ts):
    seen: list = []
    ts.record_listeners.append(lambda record: seen.append(record.loss))
    for loss in [1.0, math.nan, math.inf, 2.0, math.nan]:
        with ts.step(samples=4) as s:
            s.loss = loss
    ts.collector.flush()
    stored = store.query(ts.run_dir, "SELECT loss FROM steps ORDER BY step").column(0).to_pylist()
    assert stored == [1.0, None, None, 2.0, None]
    assert [x if math.isfinite(x) else "x" for x in seen] == [1.0, "x", "x", 2.0, "x"]
    events = store.query(ts.run_dir, "SELECT step FROM events WHERE name = 'nonfinite_loss'")
    assert sorted(events.column("step").to_pylist()) == [1, 4]
    report = validate_target(str(ts.run_dir))
    assert not [v for v in report.violations if v.metric == "trainspec.step.loss"]
