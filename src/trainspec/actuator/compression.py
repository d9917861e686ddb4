"""Compression level: raise it when communication-bound outside critical regimes, lower it
in critical regimes or when the loss degrades.

After Accordion (Agarwal et al., MLSys 2021), which switches between a gentle and an
aggressive compression setting on its critical-regime detector. Levels move one rung at a
time along `ladder` (least to most compressed: the configuration's rules refuse a ladder out
of order at two ranks, config_rules.py), with `cooldown` windows after each change so a
switch is judged on windows measured after it. A level that is not on the ladder (set by
`kernels.compression` or an operator) is left where it is, with a warning and an advice
event: read as rung 0, `lowrank:2` was "raised" to bf16, 5.4x the bytes.

The configuration cannot know the world size; the policy does (one summary per rank). int8
and topk are all-gathers, whose bytes grow with the world where an all-reduce's do not: at
4 ranks `int8` sends more than `bf16`, from 8 more than `none`. So the policy rates the
ladder at the job's world size (`rate_ladder`, by `kernels.wire.level_sent_bytes`, the count
the hook's wire makes) and never moves to a rung that sends no fewer bytes than a rung kept
before it; the rungs skipped are said once, in a warning and an advice event. A job that is
at a skipped rung (its `kernels.compression`, an operator's level) moves down to the kept
rung before it and up to the kept rung after it, or, communication-bound with none after
it, to the one before it, which sends fewer bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from trainspec.actuator.findings import Action
from trainspec.actuator.state_fields import finite_or_none, read_count, read_float
from trainspec.actuator.summary import RankSummary
from trainspec.config_rules import nominal_sends_less
from trainspec.kernels.codecs import LevelError, parse_level, resolve_level
from trainspec.kernels.wire import level_sent_bytes

log = logging.getLogger("trainspec.actuator")

DEFAULT_LADDER = ("none", "bf16", "int8")
# The bucket a rung is rated on: DDP's default bucket_cap_mb, 25 MiB of float32 values. The
# bucket size matters only through rounding (int8's last block, topk's ceil(F n)).
RATED_VALUES = 25 * 2**20 // 4


def canonical_level(text: str, int8_block: int | None = None) -> str:
    """The name the hook reports for a level (`hook.level`): `topk:.01` is `topk:0.01`,
    `INT8:256` is `int8`, and a plain `int8` is `int8:B` in a job whose
    `kernels.int8_block_size` B is not 256. Text that names no level is kept as it is (the
    configuration's rules refuse such a ladder before it gets here)."""
    try:
        return str(resolve_level(text, int8_block))
    except LevelError:
        return text.strip()


def rung_sent_bytes(rung: str, world_size: int) -> int | None:
    """Bytes a rank sends for a bucket of RATED_VALUES values at level `rung` (a canonical
    name: a plain `int8` is block 256); None for a lowrank level or a rung naming no level."""
    try:
        level = parse_level(rung)
    except LevelError:
        return None
    return level_sent_bytes(level, RATED_VALUES, world_size)


def sends_fewer(later: str, earlier: str, world_size: int) -> bool | None:
    """Whether rung `later` sends fewer bytes than rung `earlier` at `world_size` ranks (a
    world of one sends nothing: rated as two); None where that is not known (a lowrank level
    against topk). Rungs the wire's count covers are compared by it; a lowrank level takes
    its place from the configuration's rating, which holds at any world size."""
    world = max(world_size, 2)
    a, b = rung_sent_bytes(later, world), rung_sent_bytes(earlier, world)
    if a is not None and b is not None:
        return a < b
    return nominal_sends_less(later, earlier)


@dataclass(frozen=True)
class Skipped:
    """A rung the policy does not move to: it sends no fewer bytes than `than`, kept before it."""

    index: int  # its place on the ladder
    rung: str
    than: str
    sent: int | None  # bytes per RATED_VALUES bucket at the world size; None: not counted
    than_sent: int | None


def rate_ladder(
    ladder: tuple[str, ...], world_size: int
) -> tuple[tuple[str, ...], tuple[Skipped, ...]]:
    """The rungs of `ladder` kept at `world_size` ranks, in the ladder's order, each sending
    fewer bytes than every kept rung before it that it can be compared with, and the rungs
    skipped. The first rung is always kept."""
    kept: list[str] = []
    skipped: list[Skipped] = []
    world = max(world_size, 2)
    for index, rung in enumerate(ladder):
        than = next((k for k in kept if sends_fewer(rung, k, world) is False), None)
        if than is None:
            kept.append(rung)
        else:
            sent, than_sent = rung_sent_bytes(rung, world), rung_sent_bytes(than, world)
            skipped.append(Skipped(index, rung, than, sent, than_sent))
    return tuple(kept), tuple(skipped)


@dataclass
class CompressionPolicy:
    ladder: tuple[str, ...] = DEFAULT_LADDER
    int8_block: int | None = None  # the job's `kernels.int8_block_size`: what plain `int8` means
    loss_degrade: float = 0.05  # window mean loss rising by more than this fraction
    cooldown: int = 2
    _cooling: int = 0
    _last_loss: float = math.nan
    _history: list[str] = field(default_factory=list)
    _off_ladder: str | None = None  # the level off the ladder last warned about
    _rated_world: int = 0  # the world size `_kept` was rated at (0: not yet)
    _kept: frozenset[int] = frozenset()  # the places on the ladder moved to at that world size
    _notice: Action | None = None  # the advice naming the rungs skipped, until given

    def __post_init__(self) -> None:
        # Rungs as the hook names its level, so the current level is found on the ladder
        # however the configuration spelled it; a plain `int8` rung is the job's int8 block.
        self.ladder = tuple(canonical_level(rung, self.int8_block) for rung in self.ladder)

    def state_dict(self) -> dict[str, Any]:
        return {"cooling": self._cooling, "last_loss": finite_or_none(self._last_loss)}

    def load_state_dict(self, state: Any) -> None:
        """Missing keys keep their value; raises StateError naming a bad one."""
        cooling = read_count(state, "cooling", self._cooling)
        last_loss = read_float(state, "last_loss", self._last_loss)
        self._cooling, self._last_loss = cooling, last_loss

    def decide(
        self,
        summaries: list[RankSummary],
        current: str,
        *,
        comm_bound: bool,
        critical: bool,
        exposed_share: float,
    ) -> Action | None:
        """`summaries`: one per rank (their number is the world size the ladder is rated at).
        The advice naming rungs skipped at this world size comes with the first decision
        that makes no move."""
        loss = _mean_loss(summaries)
        degraded = loss_rose(self._last_loss, loss, self.loss_degrade)
        self._last_loss = loss
        self.rungs_at(len(summaries))
        if self._cooling > 0:
            self._cooling -= 1
            return self._pop_notice()
        action = self._step(
            canonical_level(current),  # the hook's own name: `int8` is block 256
            len(summaries),
            comm_bound=comm_bound,
            critical=critical,
            degraded=degraded,
            exposed_share=exposed_share,
            loss=loss,
        )
        return action if action is not None else self._pop_notice()

    def rungs_at(self, world_size: int) -> tuple[str, ...]:
        """The rungs moved to at `world_size` ranks (`rate_ladder`); the first time (and
        whenever the world size changes) the rungs skipped are warned about and kept as an
        advice for `decide` to return."""
        world_size = max(world_size, 2)  # a world of one sends nothing: rated as two
        if world_size != self._rated_world:
            self._rated_world = world_size
            kept, skipped = rate_ladder(self.ladder, world_size)
            self._kept = frozenset(range(len(self.ladder))) - {s.index for s in skipped}
            self._notice = self._skip_notice(kept, skipped, world_size) if skipped else None
        return tuple(self.ladder[i] for i in sorted(self._kept))

    def _pop_notice(self) -> Action | None:
        notice, self._notice = self._notice, None
        return notice

    def _skip_notice(
        self, kept: tuple[str, ...], skipped: tuple[Skipped, ...], world_size: int
    ) -> Action:
        def said(s: Skipped) -> str:
            counts = (
                f" ({s.sent} vs {s.than_sent} bytes per {RATED_VALUES} values)"
                if s.sent is not None and s.than_sent is not None
                else ""
            )
            return f"{s.rung} sends no fewer bytes than {s.than}{counts}"

        reason = (
            f"at {world_size} ranks {'; '.join(said(s) for s in skipped)}: the compression "
            f"policy skips {', '.join(s.rung for s in skipped)} on actuator.compression_ladder "
            f"({','.join(self.ladder)}) and moves along {','.join(kept)}"
        )
        log.warning("trainspec: %s", reason)
        return Action(
            "advice",
            f"{reason}; consider a ladder without {', '.join(s.rung for s in skipped)}",
            evidence={
                "world_size": world_size,
                "ladder": list(self.ladder),
                "rungs": list(kept),
                "skipped": {
                    s.rung: {"than": s.than, "bytes": s.sent, "than_bytes": s.than_sent}
                    for s in skipped
                },
                "bucket_values": RATED_VALUES,
            },
        )

    def _step(
        self,
        current: str,
        world_size: int,
        *,
        comm_bound: bool,
        critical: bool,
        degraded: bool,
        exposed_share: float,
        loss: float,
    ) -> Action | None:
        if current not in self.ladder:
            return self._off_the_ladder(current)
        self._off_ladder = None
        rung = self.ladder.index(current)
        below = [self.ladder[i] for i in sorted(self._kept) if i < rung]
        above = [self.ladder[i] for i in sorted(self._kept) if i > rung]
        evidence = {"exposed_share": round(exposed_share, 4), "critical": critical, "loss": loss}
        if below and (critical or degraded):
            why = "a critical gradient regime" if critical else "the loss rose"
            return self._move(current, below[-1], f"lower compression: {why}", evidence)
        if not comm_bound or critical:
            return None
        if above and sends_fewer(above[0], current, world_size) is not False:
            reason = (
                f"raise compression: exposed communication is {exposed_share:.0%} of the step "
                "outside a critical gradient regime"
            )
            return self._move(current, above[0], reason, evidence)
        if rung not in self._kept and below and sends_fewer(below[-1], current, world_size):
            reason = (
                f"fewer bytes: exposed communication is {exposed_share:.0%} of the step, and at "
                f"{world_size} ranks {current} sends more than {below[-1]}"
            )
            return self._move(current, below[-1], reason, evidence)
        return None

    def _off_the_ladder(self, current: str) -> Action | None:
        """No move from a level the ladder does not hold: where it sits between the rungs is
        not known here (a lowrank level's bytes depend on the model). Said once per level."""
        if current == self._off_ladder:
            return None
        self._off_ladder = current
        reason = (
            f"compression level {current} is not on actuator.compression_ladder "
            f"({','.join(self.ladder)}): the compression policy leaves it as it is"
        )
        log.warning("trainspec: %s", reason)
        return Action(
            "advice",
            f"{reason}; consider a ladder that includes it",
            evidence={"level": current, "ladder": list(self.ladder)},
        )

    def _move(self, before: str, after: str, reason: str, evidence: dict) -> Action:
        self._cooling = self.cooldown
        self._history.append(after)
        return Action(
            "compression",
            reason,
            before={"level": before},
            after={"level": after},
            evidence=evidence,
        )


def loss_rose(last: float, loss: float, fraction: float) -> bool:
    """Whether the window mean `loss` rose above the previous window's `last` by more than
    `fraction` of its magnitude. Against |last|, so a negative loss (a log-likelihood
    objective, an ELBO) that falls from -2.0 to -2.05 improved, where `loss > last * (1 +
    fraction)` read it as a rise. A previous loss of exactly 0 gives no scale to judge a
    relative rise by: not a rise (the next window is judged against this one)."""
    if not (math.isfinite(loss) and math.isfinite(last)) or last == 0:
        return False
    return loss - last > fraction * abs(last)


def _mean_loss(summaries: list[RankSummary]) -> float:
    values = [s.loss_mean for s in summaries if math.isfinite(s.loss_mean)]
    return sum(values) / len(values) if values else math.nan
