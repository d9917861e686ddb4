"""Fault injection, so stragglers and failures can be staged on any machine.

A plan comes from `TRAINSPEC_INJECT` (only with `TRAINSPEC_ALLOW_INJECT=1`, so a stray variable
never kills a production job) or from the builder, after torchft's integration tests
(`FaultPlan().fail_at(rank=1, step=7)`). Grammar: faults separated by `;`, each
`kind:key=value,key=value`:

    kill:rank=1,step=7            SIGKILL that rank at the start of that step
    slow:rank=0,factor=2          that rank sleeps (factor - 1) x its measured compute time
    preempt:step=30               SIGTERM (all ranks unless rank= is given) at that step
    squeeze:rank=1,step=10        from that step on, the rank's memory probe reports pressure
                                  0.99 (`pressure=P` to choose it), on CPU or GPU alike
    squeeze:rank=1,bytes=2e9      ... or reports its real pressure plus 2e9 bytes' worth of the
                                  device's (CUDA) or host's (CPU) capacity
    oom:rank=1,step=12,max_micro=4  from that step on, a forward over a micro-batch of more than
                                  4 samples raises torch.OutOfMemoryError (inside the model's
                                  forward, as a real one would), so the OOM retry can be staged
    oom_backward:rank=1,step=12,max_micro=4  the same, raised in the backward (when the
                                  gradient of the model's first parameter is computed)
    spike:step=20                 parsed and exposed (`faults_at`) for the script to act on
    ecc:rank=1,step=20            at the end of that step the rank's hardware-health watch sees
                                  an uncorrected ECC error (runtime/hardware_health.py)
    latency:rank=1,step=20,ms=20  from that step on, the probe latency the rank's controller
                                  sees is the reading plus 20 ms (runtime/probe_latency.py)

`attempt=N` limits a fault to the Nth torchrun attempt (TORCHELASTIC_RESTART_COUNT); kill and
preempt default to attempt 0, so a restarted job is not killed again at the same step; the
others default to every attempt. `step=` on slow, squeeze, oom and latency means "from this step on".
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainspec.runtime.identity import restart_count

ENV_SPEC = "TRAINSPEC_INJECT"
ENV_ALLOW = "TRAINSPEC_ALLOW_INJECT"

# kind -> (keys it accepts, keys it requires)
_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "kill": (frozenset({"rank", "step", "attempt"}), frozenset({"rank", "step"})),
    "slow": (frozenset({"rank", "factor", "step", "attempt"}), frozenset({"rank", "factor"})),
    "preempt": (frozenset({"rank", "step", "attempt"}), frozenset({"step"})),
    "squeeze": (frozenset({"rank", "bytes", "pressure", "step", "attempt"}), frozenset({"rank"})),
    "oom": (frozenset({"rank", "step", "max_micro", "attempt"}), frozenset({"rank", "max_micro"})),
    "oom_backward": (
        frozenset({"rank", "step", "max_micro", "attempt"}),
        frozenset({"rank", "max_micro"}),
    ),
    "spike": (frozenset({"step", "factor", "attempt"}), frozenset({"step"})),
    "ecc": (frozenset({"rank", "step", "attempt"}), frozenset({"rank", "step"})),
    "latency": (frozenset({"rank", "step", "ms", "attempt"}), frozenset({"rank", "step", "ms"})),
}
_ONCE_KINDS = frozenset({"kill", "preempt"})
SQUEEZE_PRESSURE = 0.99  # what a squeeze without bytes= reports: above any sane threshold
MAX_SLOW_SLEEP_S = 1e6  # a slow fault's sleep per step, at most: time.sleep overflows past ~1e10
_NUMERIC = ("rank", "step", "attempt", "factor", "bytes", "pressure", "max_micro", "ms")


class InjectSpecError(ValueError):
    """A `TRAINSPEC_INJECT` specification that cannot be parsed."""


class InjectionNotAllowedError(ValueError):
    """`TRAINSPEC_INJECT` was set without the explicit opt-in `TRAINSPEC_ALLOW_INJECT=1`: a
    bad setting, as a bad specification is (a ValueError, so a script catches both)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: every rank
    step: int | None = None  # None: every step (slow from step 0)
    attempt: int | None = None  # None: every attempt
    factor: float | None = None
    bytes: int | None = None
    pressure: float | None = None
    max_micro: int | None = None
    ms: float | None = None  # latency: milliseconds added to the probe readings

    def __post_init__(self) -> None:
        """The builder's faults too: a NaN or infinite field is refused here, not by the rank
        that acts on it (time.sleep overflows on an infinite slow factor)."""
        for key in _NUMERIC:
            value = getattr(self, key)
            if value is not None and not math.isfinite(value):
                raise InjectSpecError(
                    f"{self.kind} fault: field {key} must be a finite number, not {value!r}"
                )

    def applies(self, rank: int, attempt: int) -> bool:
        return (self.rank is None or self.rank == rank) and (
            self.attempt is None or self.attempt == attempt
        )

    def render(self) -> str:
        parts = [f"{k}={_fmt(getattr(self, k))}" for k in _NUMERIC if getattr(self, k) is not None]
        return f"{self.kind}:{','.join(parts)}"


def _fmt(value: float | int) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass
class FaultPlan:
    """An ordered list of faults; build with the fluent methods or `parse`."""

    faults: list[Fault] = field(default_factory=list)

    def fail_at(self, rank: int, step: int, *, attempt: int = 0) -> FaultPlan:
        return self._add(Fault("kill", rank=rank, step=step, attempt=attempt))

    def slow(self, rank: int, factor: float, *, from_step: int | None = None) -> FaultPlan:
        return self._add(Fault("slow", rank=rank, step=from_step, factor=float(factor)))

    def preempt_at(self, step: int, *, rank: int | None = None, attempt: int = 0) -> FaultPlan:
        return self._add(Fault("preempt", rank=rank, step=step, attempt=attempt))

    def squeeze(
        self,
        rank: int,
        nbytes: int | None = None,
        *,
        step: int | None = None,
        pressure: float | None = None,
    ) -> FaultPlan:
        size = int(nbytes) if nbytes is not None else None
        return self._add(Fault("squeeze", rank=rank, step=step, bytes=size, pressure=pressure))

    def oom(self, rank: int, max_micro: int, *, from_step: int | None = None) -> FaultPlan:
        return self._add(Fault("oom", rank=rank, step=from_step, max_micro=int(max_micro)))

    def spike_at(self, step: int, *, factor: float | None = None) -> FaultPlan:
        return self._add(Fault("spike", step=step, factor=factor))

    def _add(self, fault: Fault) -> FaultPlan:
        self.faults.append(fault)
        return self

    def to_env(self) -> dict[str, str]:
        """Environment that makes a child job run this plan."""
        return {ENV_SPEC: ";".join(f.render() for f in self.faults), ENV_ALLOW: "1"}

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        plan = cls()
        for item in (part.strip() for part in text.split(";")):
            if item:
                plan.faults.append(_parse_fault(item))
        return plan

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan in `TRAINSPEC_INJECT`; empty when unset; refused without the opt-in."""
        env = os.environ if environ is None else environ
        text = env.get(ENV_SPEC, "").strip()
        if not text:
            return cls()
        if env.get(ENV_ALLOW) != "1":
            raise InjectionNotAllowedError(
                f"{ENV_SPEC} is set but fault injection is not enabled; set {ENV_ALLOW}=1 to allow it"
            )
        return cls.parse(text)


def _parse_fault(item: str) -> Fault:
    kind, sep, body = item.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise InjectSpecError(f"unknown fault kind {kind!r} in {item!r}; known: {sorted(_KINDS)}")
    allowed, required = _KINDS[kind]
    values: dict[str, float] = {}
    for pair in filter(None, (p.strip() for p in body.split(","))) if sep else ():
        key, eq, raw = pair.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise InjectSpecError(f"bad field {pair!r} in {item!r}; {kind} takes {sorted(allowed)}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise InjectSpecError(f"field {key} in {item!r} is not a number: {raw!r}") from None
    missing = required - values.keys()
    if missing:
        raise InjectSpecError(f"{item!r} lacks {sorted(missing)}")
    ints = {
        k: _as_int(k, values[k], item)
        for k in ("rank", "step", "attempt", "bytes", "max_micro")
        if k in values
    }
    if "factor" in values and values["factor"] < 1.0 and kind == "slow":
        raise InjectSpecError(f"slow factor must be >= 1 in {item!r}")
    if "ms" in values and not 0.0 < values["ms"] < math.inf:
        raise InjectSpecError(f"latency ms must be a positive number in {item!r}")
    if "pressure" in values and not 0.0 < values["pressure"] <= 1.0:
        raise InjectSpecError(f"squeeze pressure must be in (0, 1] in {item!r}")
    if ints.get("max_micro", 1) < 1:
        raise InjectSpecError(f"oom max_micro must be at least 1 in {item!r}")
    for key, value in values.items():  # the rest: slow's factor=inf killed the rank in sleep
        if not math.isfinite(value):
            raise InjectSpecError(f"field {key} in {item!r} must be a finite number, not {value}")
    attempt = ints.get("attempt", 0 if kind in _ONCE_KINDS else None)
    return Fault(
        kind,
        rank=ints.get("rank"),
        step=ints.get("step"),
        attempt=attempt,
        factor=values.get("factor"),
        bytes=ints.get("bytes"),
        pressure=values.get("pressure"),
        max_micro=ints.get("max_micro"),
        ms=values.get("ms"),
    )


def _as_int(key: str, value: float, item: str) -> int:
    if not value.is_integer() or value < 0:
        raise InjectSpecError(f"field {key} in {item!r} must be a non-negative integer")
    return int(value)


class Injector:
    """Acts on a plan for one rank: call `at_step_start` and `after_compute` from the loop."""

    def __init__(self, plan: FaultPlan, *, rank: int, attempt: int | None = None) -> None:
        self.rank = rank
        self.attempt = restart_count() if attempt is None else attempt
        self.faults = [f for f in plan.faults if f.applies(rank, self.attempt)]

    @classmethod
    def from_env(cls, *, rank: int) -> Injector:
        return cls(FaultPlan.from_env(), rank=rank)

    def faults_at(self, kind: str, step: int) -> list[Fault]:
        """Faults of `kind` due exactly at `step` for this rank (spike is acted on by the script)."""
        return [f for f in self.faults if f.kind == kind and (f.step is None or f.step == step)]

    def at_step_start(self, step: int) -> None:
        """SIGKILL or SIGTERM this process if the plan says so for this step."""
        if self.faults_at("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults_at("preempt", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def active(self, kind: str, step: int) -> list[Fault]:
        """Faults of a from-this-step-on kind (slow, squeeze, oom, oom_backward, latency) in
        force at `step`."""
        return [f for f in self.faults if f.kind == kind and (f.step or 0) <= step]

    def slow_factor(self, step: int) -> float:
        return max((f.factor or 1.0 for f in self.active("slow", step)), default=1.0)

    def squeezed_pressure(self, step: int, pressure: float, capacity_bytes: float) -> float:
        """The memory pressure the probe reports at `step` under this rank's squeeze faults."""
        for f in self.active("squeeze", step):
            if f.bytes is not None and capacity_bytes > 0:
                pressure = max(pressure, min(1.0, pressure + f.bytes / capacity_bytes))
            if f.pressure is not None or f.bytes is None:
                pressure = max(pressure, f.pressure if f.pressure is not None else SQUEEZE_PRESSURE)
        return pressure

    def oom_limit(self, step: int, kind: str = "oom") -> int | None:
        """The largest micro-batch that fits at `step` under this rank's `kind` faults (oom,
        oom_backward), if any."""
        limits = [f.max_micro for f in self.active(kind, step) if f.max_micro is not None]
        return min(limits) if limits else None

    def check_micro_batch(self, step: int, size: int, *, kind: str = "oom") -> None:
        """Raise torch.OutOfMemoryError when a `kind` fault says a micro-batch of `size` does
        not fit at `step` (call it where a real one is raised: forward for oom, backward for
        oom_backward)."""
        limit = self.oom_limit(step, kind)
        if limit is not None and size > limit:
            import torch

            raise torch.OutOfMemoryError(
                f"injected out of memory: micro-batch of {size} > {limit} at step {step} "
                f"(TRAINSPEC_INJECT {kind}, rank {self.rank})"
            )

    def after_compute(self, step: int, compute_s: float) -> float:
        """Sleep (factor - 1) x this step's compute time, as a slower GPU would, at most
        MAX_SLOW_SLEEP_S; returns the sleep."""
        delay = min((self.slow_factor(step) - 1.0) * max(compute_s, 0.0), MAX_SLOW_SLEEP_S)
        if delay > 0:
            time.sleep(delay)
        return delay
