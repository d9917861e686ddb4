"""Violations grouped for people: one entry per (metric, rule) shared by several ranks.

A problem every rank shares is found once per rank: a 1,024-rank run missing 5 metrics has
5,120 violations. People read one line per (metric, rule) with its ranks as ranges
(`0-511, 700, 900-903`), how many, and one representative's evidence: the worst where the
rule's evidence measures how bad it is (`_MEASURES`), else the lowest rank's. Machines read
every violation (`Report.render_json`); grouping only changes what people are shown.

An entry that would stand for one rank only is left as it is, one per violation, so a run
whose problems are each on one rank reads as it did before grouping. A run-level violation
(rank None) is never grouped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainspec.schema.verdict import Violation

RANGES_SHOWN = 16  # rank ranges written out on one line; the rest are counted
_NUMBER = r"([-+]?(?:inf|\d+(?:\.\d*)?(?:e[-+]?\d+)?))"


def format_ranks(ranks: Iterable[int], *, limit: int | None = None) -> str:
    """Ranks as sorted ranges, `0-511, 700, 900-903`; duplicates count once, "" for none.

    With `limit`, at most that many ranges are written and the ranks left out are counted:
    `0, 2, 4, … +509 more`.
    """
    spans = _spans(sorted(set(ranks)))
    text = [str(a) if a == b else f"{a}-{b}" for a, b in spans[:limit]]
    left = sum(b - a + 1 for a, b in spans[len(text) :])
    if left:
        text.append(f"… +{left:,} more")
    return ", ".join(text)


def _spans(ordered: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive integers in sorted, distinct `ordered`, as (first, last)."""
    spans: list[tuple[int, int]] = []
    for r in ordered:
        if spans and r == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    return spans


def _measure(pattern: str) -> Callable[[str], float | None]:
    """How bad a violation is: the number `pattern` captures from its evidence, if any."""
    compiled = re.compile(pattern.replace("NUM", _NUMBER), re.IGNORECASE)

    def measure(evidence: str) -> float | None:
        m = compiled.search(evidence)
        return float(m.group(1)) if m else None

    return measure


def _overshoot(evidence: str) -> float | None:
    """How far a value lies beyond its range: `minimum -0.3 < 0` and `maximum 1.2 > 1`
    are 0.3 and 0.2 out, so the lowest minimum and the highest maximum are the worst."""
    m = re.match(rf"(?:minimum|maximum) {_NUMBER} [<>] {_NUMBER}", evidence, re.IGNORECASE)
    return abs(float(m.group(1)) - float(m.group(2))) if m else None


# Rules whose evidence (worded in trainspec.schema.validate) starts with how bad it is;
# the other rules' evidence names what is wrong, with no measure to rank by.
_MEASURES: dict[str, Callable[[str], float | None]] = {
    "cadence": _measure(r"^(?:p95 gap|no value on) NUM"),  # seconds, or steps without one
    "finite": _measure(r"^NUM of"),  # values NaN or infinite
    "time": _measure(r"^NUM of"),  # points with no finite time
    "monotonic": _measure(r"^counter went down NUM times"),
    "duplicate": _measure(r"^NUM more value"),
    "range": _overshoot,
}


@dataclass(frozen=True)
class ViolationGroup:
    """Violations of one rule on one metric: one violation, or the same on several ranks."""

    metric: str
    rule: str
    violations: tuple[Violation, ...]

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """The ranks affected, sorted and distinct (empty for a run-level violation)."""
        return tuple(sorted({v.rank for v in self.violations if v.rank is not None}))

    @property
    def grouped(self) -> bool:
        """True when this entry stands for several ranks, False for a single violation."""
        return len(self.violations) > 1

    @cached_property
    def worst(self) -> Violation | None:
        """The violation whose evidence measures worst; None where the rule has no measure."""
        measure = _MEASURES.get(self.rule)
        scored = [(measure(v.evidence), v) for v in self.violations] if measure else []
        valid = [(s, v) for s, v in scored if s is not None]
        return max(valid, key=lambda sv: sv[0])[1] if valid else None

    @property
    def representative(self) -> Violation:
        """The violation whose evidence is shown: the worst, else the lowest rank's."""
        return self.worst or min(self.violations, key=lambda v: _rank_key(v.rank))

    @property
    def uniform(self) -> bool:
        """Every violation has the same evidence, so the representative speaks for all."""
        return len({v.evidence for v in self.violations}) == 1

    @property
    def ranks_text(self) -> str:
        """`-` (run-level), `3`, or `1,024 ranks (0-1023)`; the violations are counted too
        when a rank has several (one per series, say)."""
        if not self.grouped:
            rank = self.violations[0].rank
            return "-" if rank is None else str(rank)
        text = f"{len(self.ranks):,} ranks ({format_ranks(self.ranks, limit=RANGES_SHOWN)})"
        if len(self.violations) != len(self.ranks):
            text += f", {len(self.violations):,} violations"
        return text

    @property
    def evidence_text(self) -> str:
        """The representative's evidence, saying which rank it is from when ranks differ."""
        shown = self.representative
        if self.uniform:
            return shown.evidence
        if self.worst is not None:
            return f"{shown.evidence}  (worst: rank {shown.rank})"
        return f"{shown.evidence}  (as on rank {shown.rank}; others differ)"

    def render_text(self) -> str:
        """One line; a single violation reads as `Report.render_text` always printed it."""
        ranks = self.ranks_text if self.grouped else f"rank {self.ranks_text}"
        return f"  {self.metric}  {ranks}  [{self.rule}]  {self.evidence_text}"

    def to_row(self) -> dict[str, object]:
        """The entry as a table row, for the dashboards."""
        return {
            "metric": self.metric,
            "ranks": self.ranks_text,
            "rule": self.rule,
            "evidence": self.evidence_text,
            "violations": len(self.violations),
        }


def _rank_key(rank: int | None) -> int:
    return -1 if rank is None else rank


def group_violations(violations: Sequence[Violation]) -> list[ViolationGroup]:
    """One entry per (metric, rule) found on two or more ranks, placed where its first
    violation was; every other violation (run-level, or its rule on one rank only) is an
    entry of its own, in its place. Each violation is in exactly one entry."""
    members: dict[tuple[str, str], list[Violation]] = {}
    for v in violations:
        if v.rank is not None:
            members.setdefault((v.metric, v.rule), []).append(v)
    shared = {key for key, vs in members.items() if len({v.rank for v in vs}) > 1}
    entries: list[ViolationGroup] = []
    placed: set[tuple[str, str]] = set()
    for v in violations:
        key = (v.metric, v.rule)
        if v.rank is None or key not in shared:
            entries.append(ViolationGroup(v.metric, v.rule, (v,)))
        elif key not in placed:
            placed.add(key)
            entries.append(ViolationGroup(v.metric, v.rule, tuple(members[key])))
    return entries


def each_violation(violations: Sequence[Violation]) -> list[ViolationGroup]:
    """Every violation an entry of its own, in order: `trainspec validate --by-rank`."""
    return [ViolationGroup(v.metric, v.rule, (v,)) for v in violations]
