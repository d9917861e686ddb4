"""The closed loop: detectors, policies and actions, applied at step boundaries, alike on every rank.

Contract:
- A `Controller` lives on every rank. The runtime feeds it each `StepRecord` (`on_record`) and
  calls `on_boundary(steps_done)` after every step. Every `window_steps` steps it gathers one
  compact `RankSummary` per rank on the control gloo group (`gather.py`), runs the detectors
  (`straggler.py`, `bottlenecks.py`, `regime.py`, `loss.py`, `memory.py`) and the policies
  (`rebalance.py`, `compression.py`, `checkpointing.py`, `memory_policy.py`) on the gathered
  data, and applies the resulting actions (`actions.py`) before the next step. Same data, same pure decisions: every
  rank applies the same plan at the same step.
- A failed gather, or ranks whose applied-plan counts disagree, stops the controller on every
  rank and is recorded as an event; the job keeps the plan it has and never stops for it.
- Dry run records what it would do and changes nothing. Every anomaly and action is an event
  (kind, step, ranks, evidence, before/after, reason in words).
- Bounds, hysteresis (`patience` windows) and cool-downs keep noise from making it oscillate.
"""

from __future__ import annotations

from trainspec.actuator.actions import Targets
from trainspec.actuator.controller import ControlCost, Controller
from trainspec.actuator.findings import Action, Finding
from trainspec.actuator.summary import FLAG_HARDWARE, FLAG_PREEMPT, RankSummary

__all__ = [
    "FLAG_HARDWARE",
    "FLAG_PREEMPT",
    "Action",
    "ControlCost",
    "Controller",
    "Finding",
    "RankSummary",
    "Targets",
]
