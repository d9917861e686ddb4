"""The one place the dashboards call the compliance validator.

The validator (`trainspec.store.compliance.validate_target`, rules in
`trainspec.schema.validate`) may be absent from an installation; the Compliance view then
says "validator not installed" instead of failing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

VALIDATOR_MODULE = "trainspec.store.compliance"
NOT_INSTALLED = "validator not installed"


@dataclass
class ComplianceResult:
    available: bool  # False: the validator module is missing
    compliant: bool | None = None  # None: not judged (missing validator or unreadable run)
    violations: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=["metric", "rank", "rule", "evidence"])
    )
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
        n = len(self.violations)
        return f"{n} violation{'s' * (n != 1)} of catalogue {self.catalogue_version}"


def check_run(run: str | Path, module: str = VALIDATOR_MODULE) -> ComplianceResult:
    """Judge `run` with the validator; never raises for a missing validator or a bad run."""
    try:
        validator = importlib.import_module(module)
    except ImportError:
        return ComplianceResult(available=False)
    try:
        report = validator.validate_target(Path(run))
    except Exception as exc:  # the validator's own typed errors vary: show, don't crash
        return ComplianceResult(available=True, error=str(exc).splitlines()[0] or repr(exc))
    rows = [v.to_dict() for v in report.violations]
    return ComplianceResult(
        available=True,
        compliant=report.compliant,
        violations=pd.DataFrame(rows, columns=["metric", "rank", "rule", "evidence"]),
        warnings=list(report.warnings),
        catalogue_version=report.catalogue_version,
    )
