"""Fault injection, so stragglers and failures can be staged on any machine.

A plan comes from `TRAINSPEC_INJECT` (only with `TRAINSPEC_ALLOW_INJECT=1`, so a stray variable
never kills a production job) or from the builder, after torchft's integration tests
(`FaultPlan().fail_at(rank=1, step=7)`). Grammar: faults separated by `;`, each
`kind:key=value,key=value`:

    kill:rank=1,step=7            SIGKILL that rank at the start of that step
    slow:rank=0,factor=2          that rank sleeps (factor - 1) x its measured compute time
    preempt:step=30               SIGTERM (all ranks unless rank= is given) at that step
    squeeze:rank=1,bytes=2e9      parsed and exposed (`faults_at`) for the actuator to act on
    spike:step=20                 parsed and exposed (`faults_at`) for the actuator to act on

`attempt=N` limits a fault to the Nth torchrun attempt (TORCHELASTIC_RESTART_COUNT); kill and
preempt default to attempt 0, so a restarted job is not killed again at the same step; the
others default to every attempt. `step=` on slow means "from this step on".
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

ENV_SPEC = "TRAINSPEC_INJECT"
ENV_ALLOW = "TRAINSPEC_ALLOW_INJECT"

# kind -> (keys it accepts, keys it requires)
_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "kill": (frozenset({"rank", "step", "attempt"}), frozenset({"rank", "step"})),
    "slow": (frozenset({"rank", "factor", "step", "attempt"}), frozenset({"rank", "factor"})),
    "preempt": (frozenset({"rank", "step", "attempt"}), frozenset({"step"})),
    "squeeze": (frozenset({"rank", "bytes", "step", "attempt"}), frozenset({"rank", "bytes"})),
    "spike": (frozenset({"step", "factor", "attempt"}), frozenset({"step"})),
}
_ONCE_KINDS = frozenset({"kill", "preempt"})


class InjectSpecError(ValueError):
    """A `TRAINSPEC_INJECT` specification that cannot be parsed."""


class InjectionNotAllowedError(RuntimeError):
    """`TRAINSPEC_INJECT` was set without the explicit opt-in `TRAINSPEC_ALLOW_INJECT=1`."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: every rank
    step: int | None = None  # None: every step (slow from step 0)
    attempt: int | None = None  # None: every attempt
    factor: float | None = None
    bytes: int | None = None

    def applies(self, rank: int, attempt: int) -> bool:
        return (self.rank is None or self.rank == rank) and (
            self.attempt is None or self.attempt == attempt
        )

    def render(self) -> str:
        keys = ("rank", "step", "attempt", "factor", "bytes")
        parts = [f"{k}={_fmt(getattr(self, k))}" for k in keys if getattr(self, k) is not None]
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

    def squeeze(self, rank: int, nbytes: int, *, step: int | None = None) -> FaultPlan:
        return self._add(Fault("squeeze", rank=rank, step=step, bytes=int(nbytes)))

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
        k: _as_int(k, values[k], item) for k in ("rank", "step", "attempt", "bytes") if k in values
    }
    if "factor" in values and values["factor"] < 1.0 and kind == "slow":
        raise InjectSpecError(f"slow factor must be >= 1 in {item!r}")
    attempt = ints.get("attempt", 0 if kind in _ONCE_KINDS else None)
    return Fault(
        kind,
        rank=ints.get("rank"),
        step=ints.get("step"),
        attempt=attempt,
        factor=values.get("factor"),
        bytes=ints.get("bytes"),
    )


def _as_int(key: str, value: float, item: str) -> int:
    if not value.is_integer() or value < 0:
        raise InjectSpecError(f"field {key} in {item!r} must be a non-negative integer")
    return int(value)


class Injector:
    """Acts on a plan for one rank: call `at_step_start` and `after_compute` from the loop."""

    def __init__(self, plan: FaultPlan, *, rank: int, attempt: int | None = None) -> None:
        self.rank = rank
        self.attempt = (
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        )
        self.faults = [f for f in plan.faults if f.applies(rank, self.attempt)]

    @classmethod
    def from_env(cls, *, rank: int) -> Injector:
        return cls(FaultPlan.from_env(), rank=rank)

    def faults_at(self, kind: str, step: int) -> list[Fault]:
        """Faults of `kind` due at `step` for this rank (squeeze and spike are acted on by callers)."""
        return [f for f in self.faults if f.kind == kind and (f.step is None or f.step == step)]

    def at_step_start(self, step: int) -> None:
        """SIGKILL or SIGTERM this process if the plan says so for this step."""
        if self.faults_at("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults_at("preempt", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def slow_factor(self, step: int) -> float:
        factors = [
            f.factor or 1.0 for f in self.faults if f.kind == "slow" and (f.step or 0) <= step
        ]
        return max(factors, default=1.0)

    def after_compute(self, step: int, compute_s: float) -> float:
        """Sleep (factor - 1) x this step's compute time, as a slower GPU would; returns the sleep."""
        delay = (self.slow_factor(step) - 1.0) * max(compute_s, 0.0)
        if delay > 0:
            time.sleep(delay)
        return delay
