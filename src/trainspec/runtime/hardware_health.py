"""Wiring hardware health into the actuator: the collector's readings feed a
`HardwareHealthWatch` (on the sampling thread), and at every step boundary, before the
controller's own boundary work, this rank's new faults are recorded as anomaly events and
raised as FLAG_HARDWARE, which reaches every rank with the next window and makes the
checkpoint policy save at once.

`TRAINSPEC_INJECT` may stage one: `ecc:rank=R,step=S` hands the watch an uncorrected-ECC
count rising by one on a GPU named "injected" at step S, the reading the NVML sampler
would deliver for a real one (runtime/inject.py).
"""

from __future__ import annotations

from typing import Any

from trainspec.actuator import FLAG_HARDWARE, Controller
from trainspec.actuator.hardware import HardwareHealthWatch
from trainspec.collector.records import attrs_json
from trainspec.runtime.inject import Injector

_INJECTED = attrs_json({"gpu.index": "injected"})
ECC_METRIC = "trainspec.gpu.errors.ecc"


def attach_hardware_health(
    session: Any, controller: Controller, injector: Injector
) -> HardwareHealthWatch | None:
    """Register the watch on the session's collector; None when there is no collector."""
    if session.collector is None:
        return None
    watch = HardwareHealthWatch()
    session.collector.add_tap(watch.observe)
    staged = [f for f in injector.faults if f.kind == "ecc"]
    if staged:
        watch.observe([(ECC_METRIC, 0.0, _INJECTED)])

    def on_boundary(steps_done: int) -> None:
        step = steps_done - 1  # the step that just ended
        if any(f.step == step for f in staged):  # the count: every staged error due so far
            due = sum(1 for f in staged if f.step is not None and f.step <= step)
            watch.observe([(ECC_METRIC, float(due), _INJECTED)])
        for fault in watch.take():
            controller.raise_flag(FLAG_HARDWARE)
            session.event(
                "anomaly",
                "hardware",
                fault.reason,
                severity="error",
                evidence={"gpu": fault.gpu, "kind": fault.kind, **fault.evidence},
            )

    session.boundary_hooks.append(on_boundary)
    return watch
