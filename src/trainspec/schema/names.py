"""Naming rules: OTel metric names and the Prometheus names derived from them.

The derivation follows the OpenTelemetry-to-Prometheus compatibility rules: dots become
underscores, the UCUM unit becomes a suffix in base units (`s` -> `_seconds`, `By` ->
`_bytes`, dimensionless `1` on a gauge -> `_ratio`), annotations in braces are dropped, and
counters end in `_total`.
"""

from __future__ import annotations

import re

OTEL_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")

# UCUM unit -> Prometheus base-unit suffix. Units not listed here are refused by the catalogue.
UNIT_SUFFIX: dict[str, str] = {
    "s": "seconds",
    "By": "bytes",
    "By/s": "bytes_per_second",
    "W": "watts",
    "J": "joules",
    "Cel": "celsius",
    "Hz": "hertz",
    "1": "ratio",
}
ANNOTATION = re.compile(r"^\{[a-z_]+\}(/s)?$")


def is_valid_unit(unit: str) -> bool:
    return unit in UNIT_SUFFIX or bool(ANNOTATION.match(unit))


def unit_suffix(unit: str, instrument: str) -> str:
    """The suffix a unit adds to a Prometheus name ('' for annotations like `{sample}`)."""
    if unit == "1":
        return "ratio" if instrument == "gauge" else ""
    if unit in UNIT_SUFFIX:
        return UNIT_SUFFIX[unit]
    if unit.endswith("/s"):
        return "per_second"
    return ""


def prometheus_name(name: str, unit: str, instrument: str) -> str:
    """Derive the Prometheus metric family name for an OTel-style metric."""
    base = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    suffix = unit_suffix(unit, instrument)
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if instrument in ("counter", "event"):
        base = f"{base}_total"
    return base
