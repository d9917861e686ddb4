"""The arrows of DESIGN.md hold: each package imports only the packages it may."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "trainspec"
ALLOWED = {
    "schema": set(),
    "workload": set(),
    "data": set(),
    # config_rules: a leaf (standard library only), holding the rule a run id follows
    "store": {"schema", "config_rules"},
    # host_copy: one module, no package: device values read on the host without a sync
    "collector": {"schema", "store", "host_copy"},
    # levels: one module, the compression levels' grammar without torch (imports config)
    "kernels": {"schema", "host_copy", "levels"},
    # config_rules through config already; directly for the ladder's nominal byte rating
    "actuator": {"schema", "collector", "kernels", "config", "config_rules", "data"},
    "runtime": {
        "schema",
        "store",
        "collector",
        "kernels",
        "actuator",
        "config",
        "workload",
        "data",
        "host_copy",
        "device_events",  # one module: pooled CUDA events (phase marks), as host_copy uses
        "levels",
    },
    "agent": {"schema", "store", "collector", "config", "levels"},
    "dashboards": {"schema", "store"},
    "cli": {"*"},
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainspec" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize(
    "package", sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__")
)
def test_package_imports_only_what_design_allows(package):
    assert package in ALLOWED, f"new package {package}: add it to DESIGN's table and to ALLOWED"
    allowed = ALLOWED[package] | {package}
    if "*" in allowed:
        return
    bad = {
        (str(path.relative_to(SRC)), imported)
        for path in (SRC / package).rglob("*.py")
        for imported in _imports(path)
        if imported not in allowed
    }
    assert not bad
