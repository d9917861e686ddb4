"""Compression level: raise it when communication-bound outside critical regimes, lower it
in critical regimes or when the loss degrades.

After Accordion (Agarwal et al., MLSys 2021), which switches between a gentle and an
aggressive compression setting on its critical-regime detector. Levels move one rung at a
time along `ladder` (least to most compressed: the configuration's rules refuse a ladder out
of order, config_rules.py), with `cooldown` windows after each change so a switch is judged
on windows measured after it. A level that is not on the ladder (set by
`kernels.compression` or an operator) is left where it is, with a warning and an advice
event: read as rung 0, `lowrank:2` was "raised" to bf16, 5.4x the bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from trainspec.actuator.findings import Action
from trainspec.actuator.state_fields import finite_or_none, read_count, read_float
from trainspec.actuator.summary import RankSummary
from trainspec.kernels.codecs import LevelError, resolve_level

log = logging.getLogger("trainspec.actuator")

DEFAULT_LADDER = ("none", "bf16", "int8")


def canonical_level(text: str, int8_block: int | None = None) -> str:
    """The name the hook reports for a level (`hook.level`): `topk:.01` is `topk:0.01`,
    `INT8:256` is `int8`, and a plain `int8` is `int8:B` in a job whose
    `kernels.int8_block_size` B is not 256. Text that names no level is kept as it is (the
    configuration's rules refuse such a ladder before it gets here)."""
    try:
        return str(resolve_level(text, int8_block))
    except LevelError:
        return text.strip()


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
        loss = _mean_loss(summaries)
        degraded = (
            math.isfinite(loss)
            and math.isfinite(self._last_loss)
            and loss > self._last_loss * (1 + self.loss_degrade)
        )
        self._last_loss = loss
        if self._cooling > 0:
            self._cooling -= 1
            return None
        current = canonical_level(current)  # the hook's own name: `int8` is block 256
        if current not in self.ladder:
            return self._off_the_ladder(current)
        self._off_ladder = None
        rung = self.ladder.index(current)
        evidence = {"exposed_share": round(exposed_share, 4), "critical": critical, "loss": loss}
        if rung > 0 and (critical or degraded):
            why = "a critical gradient regime" if critical else "the loss rose"
            return self._move(current, self.ladder[rung - 1], f"lower compression: {why}", evidence)
        if comm_bound and not critical and rung + 1 < len(self.ladder):
            reason = (
                f"raise compression: exposed communication is {exposed_share:.0%} of the step "
                "outside a critical gradient regime"
            )
            return self._move(current, self.ladder[rung + 1], reason, evidence)
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


def _mean_loss(summaries: list[RankSummary]) -> float:
    values = [s.loss_mean for s in summaries if math.isfinite(s.loss_mean)]
    return sum(values) / len(values) if values else math.nan
