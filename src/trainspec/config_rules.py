"""What a valid value is, per configuration field (`trainspec.config` applies these).

One rule per field that has one, taken from the code that consumes the field: an interval
of 0 makes a thread spin, a merge fanout of 1 divides by log(1), an unknown `otel` mode
silently reads as `auto`. A field without an entry takes any value of its type.

Standard library only: `trainspec.config` is a leaf and imports nothing of trainspec
(docs/architecture.md), so the compression level grammar of `trainspec.kernels` is not
checked here; `kernels.compression` and `actuator.compression_ladder` are checked when the
hook parses them, unless the caller passes them as `extra` rules (the runtime does:
trainspec/levels.py). `PAIR_RULES` are the constraints between two fields of one section
that the actuator's constructors require; constraints on runtime values stay with the code
that knows them (`min_share` times the world size above the script's global batch switches
rebalancing off with a warning: actuator/controller.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    text: str  # completes "<key>: <value> ...", e.g. "must be a finite number > 0"
    holds: Callable[[Any], bool]


def _finite(value: Any) -> bool:
    return math.isfinite(value)


POSITIVE = Rule("must be a finite number > 0", lambda v: _finite(v) and v > 0)
NON_NEGATIVE = Rule("must be a finite number >= 0", lambda v: _finite(v) and v >= 0)
FRACTION = Rule("must be in (0, 1]", lambda v: _finite(v) and 0 < v <= 1)
ABOVE_ONE = Rule("must be a finite number > 1", lambda v: _finite(v) and v > 1)
PORT = Rule("must be a port in 0-65535 (0: off)", lambda v: 0 <= v <= 65535)


def at_least(n: float) -> Rule:
    # An int is finite (and may be too large for a float); a float must not be NaN or inf.
    return Rule(f"must be >= {n:g}", lambda v: (isinstance(v, int) or _finite(v)) and v >= n)


# The longest interval or timeout a setting may name: a day. Python's waits refuse more
# than threading.TIMEOUT_MAX (about 292 years here) with OverflowError, and a sidecar rank
# given agent.timeout_s = 1e10 lost every batch to it; nothing here needs more than a day.
SECONDS_MAX = 86_400.0


def seconds(lo: float, *, above: bool = False) -> Rule:
    """A duration: finite, at least `lo` (above it, with `above`), at most SECONDS_MAX."""
    low = f"> {lo:g}" if above else f">= {lo:g}"
    return Rule(
        f"must be a number of seconds {low} and <= {SECONDS_MAX:g} (a day)",
        lambda v: _finite(v) and (v > lo if above else v >= lo) and v <= SECONDS_MAX,
    )


def between(lo: int, hi: int) -> Rule:
    return Rule(f"must be an integer in {lo}..{hi}", lambda v: isinstance(v, int) and lo <= v <= hi)


def one_of(*choices: str) -> Rule:
    return Rule(f"must be one of {', '.join(choices)}", lambda v: v in choices)


# A run id names the run's directory under the store root (store/layout.py check_run_id).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def is_run_id(text: str) -> bool:
    return bool(RUN_ID.match(text)) and ".." not in text


RULES: dict[str, Rule] = {
    "store.run_id": Rule(
        "must be empty (generated) or a plain directory name: letters, digits, _ . : -, "
        "no '..', at most 128 characters",
        lambda v: v == "" or is_run_id(v),
    ),
    # Each flush writes a segment per table: every 50 ms is already 80 files a second.
    "store.flush_interval_s": seconds(0.05),
    "store.merge_fanout": at_least(2),  # size classes are log(span, fanout)
    # A tick costs 0.1-1 ms of CPU: below 10 ms the sampler takes a large share of a core
    # from training (the spec's interval is 50 ms).
    "collector.interval_s": seconds(0.01),
    "collector.queue_capacity": at_least(1),
    "collector.probe_timeout_s": seconds(0, above=True),
    "collector.otel": one_of("auto", "on", "off"),  # collector/sinks/otel.py otel_enabled
    "collector.prometheus_port": PORT,  # base port; rank's = base + local rank (wiring.py)
    "collector.peak_flops": NON_NEGATIVE,
    "collector.mode": one_of("embedded", "sidecar"),  # runtime/wiring.py build_sinks
    "collector.thread_nice": at_least(0),  # added to the thread's nice value; 0: unchanged
    # The agent needs a commit cycle or two to answer, and withdraws a batch by the rank's
    # deadline: a shorter wait would send most batches to the rank's own segments.
    "agent.timeout_s": seconds(1.0),
    "agent.retry_after_s": seconds(0),
    "kernels.int8_block_size": between(1, 1 << 16),  # trainspec.levels.MAX_INT8_BLOCK
    "actuator.window_steps": at_least(1),
    "actuator.patience": at_least(1),
    "actuator.straggler_score": FRACTION,
    "actuator.straggler_exit_score": FRACTION,
    "actuator.rebalance_min_gain": NON_NEGATIVE,
    "actuator.rebalance_follow_min_gain": NON_NEGATIVE,
    "actuator.rebalance_max_change": FRACTION,
    "actuator.rebalance_cooldown": at_least(0),
    "actuator.min_share": at_least(0),
    "actuator.comm_bound_share": FRACTION,
    "actuator.input_bound_share": FRACTION,
    "actuator.accordion_eta": POSITIVE,
    "actuator.loss_spike_factor": ABOVE_ONE,
    "actuator.latency_spike_factor": ABOVE_ONE,
    "actuator.latency_spike_floor_s": NON_NEGATIVE,
    "actuator.memory_pressure": FRACTION,
    "actuator.micro_batch": at_least(0),  # 0: the rank's whole share
    "actuator.min_micro_batch": at_least(1),
    "actuator.memory_cooldown": at_least(0),
    "checkpoint.keep_last": at_least(1),
    "checkpoint.mtbf_gpu_hours": POSITIVE,
}


def violation(key: str, value: Any, extra: dict[str, Rule] | None = None) -> str | None:
    """The rule `value` (already of the field's type) breaks for `key`, or None; `extra`
    rules (from a package config may not import) apply beside these."""
    rule = (extra or {}).get(key) or RULES.get(key)
    if rule is None or rule.holds(value):
        return None
    return rule.text


@dataclass(frozen=True)
class PairRule:
    first: str
    second: str
    text: str  # completes "<first> <a> and <second> <b>: ..."
    holds: Callable[[Any, Any], bool]


PAIR_RULES: tuple[PairRule, ...] = (
    PairRule(  # actuator/straggler.py: enter_score <= exit_score
        "actuator.straggler_score",
        "actuator.straggler_exit_score",
        "the first must not exceed the second",
        lambda enter, leave: enter <= leave,
    ),
    PairRule(  # actuator/rebalance.py: follow_min_gain <= min_gain
        "actuator.rebalance_follow_min_gain",
        "actuator.rebalance_min_gain",
        "the first must not exceed the second",
        lambda follow, gain: follow <= gain,
    ),
    PairRule(  # actuator/micro_batch.py: 0 (the whole share) or at least the minimum
        "actuator.micro_batch",
        "actuator.min_micro_batch",
        "the first must be 0 (the whole share) or at least the second",
        lambda batch, minimum: batch == 0 or batch >= minimum,
    ),
)


def pair_violation(rule: PairRule, get: Callable[[str], Any]) -> str | None:
    """The message naming both fields when `rule` fails for the values `get` reads."""
    a, b = get(rule.first), get(rule.second)
    if rule.holds(a, b):
        return None
    return f"{rule.first} {a!r} and {rule.second} {b!r}: {rule.text}"
