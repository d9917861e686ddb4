"""The validator's verdict: violations, warnings and notes, printed for people or as JSON.

A warning (a segment that could not be read) leaves a target compliant on what could be
read, and fails it under `--strict`; a note says what any target of its kind cannot show
(a scrape's cadence, an agent's own metrics) and fails nothing.

People read violations grouped (`trainspec.schema.groups`: one line per metric and rule
shared by several ranks); the JSON lists every violation, as `render_text(by_rank=True)`
does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from trainspec.schema.groups import (
    RANGES_SHOWN,
    ViolationGroup,
    each_violation,
    format_ranks,
    group_violations,
)


@dataclass(frozen=True)
class Violation:
    """One broken rule: which metric, on which rank, what rule, and the evidence."""

    metric: str
    rank: int | None
    rule: str
    evidence: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Report:
    target: str
    kind: str  # run | prometheus | otlp
    catalogue_version: str
    violations: list[Violation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    series: int = 0
    strict: bool = False  # warnings fail the verdict too (`trainspec validate --strict`)
    # What any target of its kind says (a scrape's cadence is not judged): printed, and never
    # a reason for `--strict` to fail.
    notes: list[str] = field(default_factory=list)

    @property
    def compliant(self) -> bool:
        return not self.violations

    @property
    def passed(self) -> bool:
        """Compliant, and under `strict` without warnings: what the exit code says."""
        return self.compliant and not (self.strict and self.warnings)

    def verdict(self) -> list[tuple[str, int | None, str, str]]:
        """The violations as plain tuples, sorted: what must not change across compaction."""
        return sorted(
            ((v.metric, v.rank, v.rule, v.evidence) for v in self.violations),
            key=lambda t: (t[0], -1 if t[1] is None else t[1], t[2], t[3]),
        )

    def groups(self) -> list[ViolationGroup]:
        """The violations as people read them: see `trainspec.schema.groups`."""
        return group_violations(self.violations)

    def render_json(self) -> str:
        doc = {
            "target": self.target,
            "kind": self.kind,
            "catalogue_version": self.catalogue_version,
            "compliant": self.compliant,
            "strict": self.strict,
            "passed": self.passed,
            "ranks": self.ranks,
            "series": self.series,
            "violations": [v.to_dict() for v in self.violations],
            "warnings": self.warnings,
            "notes": self.notes,
        }
        return json.dumps(doc, indent=1)

    def render_text(self, *, by_rank: bool = False) -> str:
        """The verdict line, the warnings, then the violations: grouped by metric and rule
        across ranks, or with `by_rank` one line per violation."""
        entries = each_violation(self.violations) if by_rank else self.groups()
        lines = [self._head() + self._verdict(len(entries))]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [entry.render_text() for entry in entries]
        return "\n".join(lines)

    def _head(self) -> str:
        known = format_ranks((r for r in self.ranks if r is not None), limit=RANGES_SHOWN)
        ranks = ", ".join(t for t in ("?" * (None in self.ranks), known) if t) or "none"
        return (
            f"{self.target} ({self.kind}, catalogue {self.catalogue_version}, "
            f"ranks {ranks}, {self.series} series): "
        )

    def _verdict(self, lines: int) -> str:
        """Counts every violation, and the lines they take where grouping shortened them."""
        if not self.compliant:
            n = len(self.violations)
            grouped = f" in {lines} group{'s' * (lines != 1)}" if 0 < lines < n else ""
            return f"{n} violation{'s' * (n != 1)}{grouped}"
        if not self.passed:
            n = len(self.warnings)
            return f"COMPLIANT, but --strict fails it on {n} warning{'s' * (n != 1)}"
        return "COMPLIANT"
