"""The validator's verdict: violations and warnings, printed for people or as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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
        }
        return json.dumps(doc, indent=1)

    def render_text(self) -> str:
        ranks = ", ".join("?" if r is None else str(r) for r in self.ranks) or "none"
        head = (
            f"{self.target} ({self.kind}, catalogue {self.catalogue_version}, "
            f"ranks {ranks}, {self.series} series): "
        )
        if not self.compliant:
            verdict = f"{len(self.violations)} violations"
        elif not self.passed:
            n = len(self.warnings)
            verdict = f"COMPLIANT, but --strict fails it on {n} warning{'s' * (n != 1)}"
        else:
            verdict = "COMPLIANT"
        lines = [head + verdict]
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        for v in self.violations:
            rank = "-" if v.rank is None else str(v.rank)
            lines.append(f"  {v.metric}  rank {rank}  [{v.rule}]  {v.evidence}")
        return "\n".join(lines)
