"""The one place the dashboards call the compliance validator.

The validator (`trainspec.store.compliance.validate_target`, rules in
`trainspec.schema.validate`) may be absent from an installation; the Compliance view then
says "validator not installed" instead of failing. A result carries every violation and
the table people read: one row per metric and rule shared by several ranks
(`trainspec.schema.groups`), so a 1,024-rank run shows a few rows, not thousands.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from trainspec.store.errors import first_line

VALIDATOR_MODULE = "trainspec.store.compliance"
NOT_INSTALLED = "validator not installed"
COLUMNS = ["metric", "rank", "rule", "evidence"]
GROUP_COLUMNS = ["metric", "ranks", "rule", "evidence", "violations"]


@dataclass
class ComplianceResult:
    available: bool  # False: the validator module is missing
    compliant: bool | None = None  # None: not judged (missing validator or unreadable run)
    violations: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COLUMNS))
    # What people read: a row per violation, or per metric and rule on several ranks.
    groups: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=GROUP_COLUMNS))
    warnings: list[str] = field(default_factory=list)
    catalogue_version: str = ""
    error: str = ""  # one line: why the run could not be judged

    @property
    def headline(self) -> str:
        if not self.available:
            return NOT_INSTALLED
        if self.error:
            return f"not judged: {self.error}"
        if self.compliant:
            return f"COMPLIANT with catalogue {self.catalogue_version}"
        n, g = len(self.violations), len(self.groups)
        grouped = f" in {g} group{'s' * (g != 1)}" if 0 < g < n else ""
        return f"{n} violation{'s' * (n != 1)} of catalogue {self.catalogue_version}{grouped}"


def check_run(run: str | Path, module: str = VALIDATOR_MODULE) -> ComplianceResult:
    """Judge `run` with the validator; never raises for a missing validator or a bad run."""
    try:
        validator = importlib.import_module(module)
    except ImportError:
        return ComplianceResult(available=False)
    try:
        report = validator.validate_target(Path(run))
    except Exception as exc:  # the validator's own typed errors vary: show, don't crash
        return ComplianceResult(available=True, error=first_line(exc))
    rows = [v.to_dict() for v in report.violations]
    groups = [g.to_row() for g in report.groups()]
    return ComplianceResult(
        available=True,
        compliant=report.compliant,
        violations=pd.DataFrame(rows, columns=COLUMNS),
        groups=pd.DataFrame(groups, columns=GROUP_COLUMNS),
        warnings=list(report.warnings),
        catalogue_version=report.catalogue_version,
    )
