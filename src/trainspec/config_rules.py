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
    # What is wrong with a value that breaks the rule, where the checker can say more than
    # `text` (a compression level's own parser: "block size must be at most 65536, got
    # 65537"); None: `text` says it all.
    why: Callable[[Any], str | None] | None = None

    def message(self, value: Any) -> str:
        """`text`, and `why`'s reason for `value` after a colon when it gives one."""
        reason = self.why(value) if self.why is not None else None
        return f"{self.text}: {reason}" if reason else self.text


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


# Bytes a rung sends per float32 gradient value at two ranks, for ordering a compression
# ladder without the kernels' grammar (trainspec/levels.py, which imports this package's
# config) and without the job's world size, which the configuration does not know: `none`
# and `bf16` are 4 and 2 bytes, `int8:B` one byte and a float32 scale per block of B,
# `topk:F` a float32 value and an int32 index for a fraction F (kernels/wire.py,
# `level_sent_bytes`, at W = 2). int8 and topk go by all-gather, whose bytes grow with the
# world where an all-reduce's do not: at more ranks they fall behind `none` and `bf16`
# (int8 sends more than bf16 from 4 ranks on), which the compression policy checks at the
# job's world size, skipping such a rung (actuator/compression.py). A lowrank level's bytes
# depend on the matrix shapes: it ranks above the dense levels (rank R sends (n + m) R of a
# matrix's n m values, with R << n, m; an all-reduce, as none and bf16, so at any world)
# and against another lowrank level by its rank (its bf16 variant at half), never against
# topk. A plain `int8` is the job's `kernels.int8_block_size`, unknown here: not ranked
# against an `int8:B` rung. A rung that names no level is left to the grammar's rule.
_DENSE_BYTES = {"none": 4.0, "bf16": 2.0}
_LOWRANK_BYTES = {"lowrank": 4.0, "lowrank-bf16": 2.0}
_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


@dataclass(frozen=True)
class _Rung:
    family: str  # dense | topk | lowrank: what its bytes can be compared with
    bytes: float  # nominal bytes sent per float32 value
    int8_block: int | None = None  # int8: its block; 0 for a plain `int8` (the job's block)


def _rung(text: str) -> _Rung | None:
    """One ladder rung's nominal cost, or None where it names no level read here."""
    kind, _, arg = text.strip().lower().partition(":")
    param = arg.split(":", 1)[0]
    value = float(param) if _NUMBER.fullmatch(param) else math.nan
    number = value if _finite(value) and value > 0 else None
    if kind in _DENSE_BYTES and not arg:
        return _Rung("dense", _DENSE_BYTES[kind])
    if kind == "int8":
        if not arg:
            return _Rung("dense", 1.0 + 4.0 / 256, int8_block=0)
        digits = param.isascii() and param.isdigit() and len(param) <= 9
        block = int(param) if digits and int(param) > 0 else None
        return _Rung("dense", 1.0 + 4.0 / block, int8_block=block) if block else None
    if kind == "topk":
        return _Rung("topk", 8.0 * number) if number else None
    if kind in _LOWRANK_BYTES:
        return _Rung("lowrank", _LOWRANK_BYTES[kind] * number) if number else None
    return None


def _sends_less(later: _Rung, earlier: _Rung) -> bool | None:
    """Whether the `later` rung sends fewer bytes than the `earlier`; None: not comparable."""
    families = {later.family, earlier.family}
    blocks = (later.int8_block, earlier.int8_block)
    if families == {"topk", "lowrank"}:
        return None
    if None not in blocks and 0 in blocks and blocks[0] != blocks[1]:
        return None  # an int8 rung against a plain int8, whose block is not known here
    if len(families) == 2 and "lowrank" in families:
        return later.family == "lowrank"
    return later.bytes < earlier.bytes


def nominal_sends_less(later: str, earlier: str) -> bool | None:
    """Whether rung `later` sends fewer bytes than rung `earlier` by the nominal costs above;
    None where they cannot be compared (a lowrank level against topk, a plain `int8`
    against an `int8:B`, a rung that names no level). Where a lowrank level is one of the
    two the answer holds at any world size (every lowrank level sends by all-reduce, and
    int8 and topk only fall further behind on larger worlds)."""
    a, b = _rung(later), _rung(earlier)
    return None if a is None or b is None else _sends_less(a, b)


def ladder_in_order(text: str) -> bool:
    """Each rung of `text` (comma-separated levels) compresses more than every rung before
    it that it can be compared with, at two ranks: the compression policy raises one rung
    up, lowers one down, so a ladder out of order turned compression on to "lower" it. At the
    job's world size the policy skips a rung that sends no fewer bytes than one before it."""
    rungs = [_rung(x) for x in text.split(",") if x.strip()]
    for i, later in enumerate(rungs):
        for earlier in rungs[:i]:
            if later is not None and earlier is not None and _sends_less(later, earlier) is False:
                return False
    return True


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
    "actuator.compression_ladder": Rule(
        "must list levels from least to most compressed, each rung sending fewer bytes than "
        "the one before at two ranks (e.g. none,bf16,int8; at more ranks the compression "
        "policy skips a rung that does not)",
        ladder_in_order,
    ),
    "checkpoint.keep_last": at_least(1),
    "checkpoint.mtbf_gpu_hours": POSITIVE,
}


def violation(key: str, value: Any, extra: dict[str, Rule] | None = None) -> str | None:
    """The rule `value` (already of the field's type) breaks for `key`, or None; `extra`
    rules (from a package config may not import) apply first, then these."""
    for rule in ((extra or {}).get(key), RULES.get(key)):
        if rule is not None and not rule.holds(value):
            return rule.message(value)
    return None


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
