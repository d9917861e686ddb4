"""The metric catalogue: a typed model over the versioned `catalogue.yaml`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainspec.schema.names import OTEL_NAME, PROMETHEUS_NAME, is_valid_unit, prometheus_name

INSTRUMENTS = ("gauge", "counter", "histogram", "event")
# When a metric is required: always; only where the run had GPUs (NVML); only on CUDA
# (torch allocator); only with more than one rank; or never (optional).
REQUIRED_WHEN = ("always", "gpu", "cuda", "distributed", "optional")
STORE_TABLES = ("samples", "steps", "events")


class CatalogueError(ValueError):
    """The catalogue file is malformed: the message names the metric and the field."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    instrument: str
    family: str
    store: str  # "samples", "steps.<column>" or "events.<kind>"
    required_when: str
    source: str
    resolution_s: float | None
    interval: float | str  # seconds, or "step" (every step), or "event" (when it happens)
    required_attributes: tuple[str, ...] = ()
    optional_attributes: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    description: str = ""
    # When a value legitimately does not exist (a ratio whose denominator is not positive):
    # steps without one are not held against a run that reports the metric's column.
    undefined_when: str = ""
    # A step may lack a value when an event of this name marks that step on that rank (the
    # gradients of a step that loss scaling skips are not finite): checked, not assumed.
    absent_with_event: str = ""
    # A step may lack a value when fewer than this many ranks trained on samples in it (a
    # variance across ranks with one rank's share at 0): checked on the stored steps.
    needs_ranks_with_samples: int = 0

    @property
    def prometheus_name(self) -> str:
        return prometheus_name(self.name, self.unit, self.instrument)

    @property
    def store_table(self) -> str:
        return self.store.split(".", 1)[0]

    @property
    def store_column(self) -> str | None:
        """The steps column or events kind this metric lives in; None for the samples table."""
        parts = self.store.split(".", 1)
        return parts[1] if len(parts) == 2 else None

    @property
    def interval_s(self) -> float | None:
        return self.interval if isinstance(self.interval, float) else None


@dataclass(frozen=True)
class Catalogue:
    version: str
    resource_attributes: tuple[str, ...]
    families: dict[str, str]
    metrics: dict[str, Metric] = field(default_factory=dict)
    operational_namespaces: tuple[str, ...] = ()  # components' own metrics, not judged

    def is_operational(self, name: str) -> bool:
        """Whether `name` (dotted, or as Prometheus spells it) is a component's own metric."""
        return any(
            name.startswith((ns + ".", ns.replace(".", "_") + "_"))
            for ns in self.operational_namespaces
        )

    def __getitem__(self, name: str) -> Metric:
        return self.metrics[name]

    def __iter__(self):
        return iter(self.metrics.values())

    def __len__(self) -> int:
        return len(self.metrics)

    def by_prometheus_name(self) -> dict[str, Metric]:
        return {m.prometheus_name: m for m in self.metrics.values()}

    def in_table(self, table: str) -> list[Metric]:
        return [m for m in self.metrics.values() if m.store_table == table]


def _metric(raw: dict[str, Any], families: dict[str, str]) -> Metric:
    name = raw.get("name")
    if not isinstance(name, str) or not OTEL_NAME.match(name):
        raise CatalogueError(f"metric name {name!r} is not a dotted lower-case OTel name")

    def need(key: str) -> Any:
        if key not in raw:
            raise CatalogueError(f"{name}: missing field {key!r}")
        return raw[key]

    unit, instrument, family = need("unit"), need("instrument"), need("family")
    if not is_valid_unit(unit):
        raise CatalogueError(f"{name}: unit {unit!r} is not a supported UCUM unit")
    if instrument not in INSTRUMENTS:
        raise CatalogueError(f"{name}: instrument {instrument!r} not one of {INSTRUMENTS}")
    if family not in families:
        raise CatalogueError(f"{name}: family {family!r} is not declared")
    required_when = need("required_when")
    if required_when not in REQUIRED_WHEN:
        raise CatalogueError(f"{name}: required_when {required_when!r} not one of {REQUIRED_WHEN}")
    store = need("store")
    if store.split(".", 1)[0] not in STORE_TABLES:
        raise CatalogueError(f"{name}: store {store!r} names no table of {STORE_TABLES}")
    interval = need("interval")
    if isinstance(interval, (int, float)):
        interval = float(interval)
        if interval <= 0:
            raise CatalogueError(f"{name}: interval must be positive seconds")
    elif interval not in ("step", "event"):
        raise CatalogueError(f"{name}: interval {interval!r} is not seconds, 'step' or 'event'")
    attrs = raw.get("attributes") or {}
    rng = raw.get("range") or {}
    metric = Metric(
        name=name,
        unit=unit,
        instrument=instrument,
        family=family,
        store=store,
        required_when=required_when,
        source=str(need("source")),
        resolution_s=raw.get("resolution_s"),
        interval=interval,
        required_attributes=tuple(attrs.get("required") or ()),
        optional_attributes=tuple(attrs.get("optional") or ()),
        minimum=rng.get("min"),
        maximum=rng.get("max"),
        description=str(raw.get("description", "")),
        undefined_when=str(raw.get("undefined_when", "")),
        absent_with_event=str(raw.get("absent_with_event", "")),
        needs_ranks_with_samples=raw.get("needs_ranks_with_samples", 0),
    )
    needs = metric.needs_ranks_with_samples
    if isinstance(needs, bool) or not isinstance(needs, int) or needs < 0:
        raise CatalogueError(f"{name}: needs_ranks_with_samples {needs!r} is not a count")
    if needs and metric.interval != "step":
        raise CatalogueError(f"{name}: needs_ranks_with_samples applies to per-step metrics only")
    event = metric.absent_with_event
    if event and not (event.replace("_", "").isalnum() and event.isascii() and event.islower()):
        raise CatalogueError(f"{name}: absent_with_event {event!r} is not an event name")
    if event and metric.interval != "step":
        raise CatalogueError(f"{name}: absent_with_event applies to per-step metrics only")
    if not PROMETHEUS_NAME.match(metric.prometheus_name):
        raise CatalogueError(
            f"{name}: derived Prometheus name {metric.prometheus_name!r} is invalid"
        )
    return metric


def parse_catalogue(text: str) -> Catalogue:
    """Parse and check catalogue YAML; raises CatalogueError naming the first problem."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogueError(f"catalogue is not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or "metrics" not in doc:
        raise CatalogueError("catalogue must be a mapping with a 'metrics' list")
    families = dict(doc.get("families") or {})
    metrics: dict[str, Metric] = {}
    prom_names: set[str] = set()
    for raw in doc["metrics"]:
        metric = _metric(raw, families)
        if metric.name in metrics:
            raise CatalogueError(f"{metric.name}: defined twice")
        if metric.prometheus_name in prom_names:
            raise CatalogueError(
                f"{metric.name}: Prometheus name {metric.prometheus_name} collides"
            )
        metrics[metric.name] = metric
        prom_names.add(metric.prometheus_name)
    return Catalogue(
        version=str(doc.get("version")),
        resource_attributes=tuple(doc.get("resource_attributes") or ()),
        families=families,
        metrics=metrics,
        operational_namespaces=tuple(doc.get("operational_namespaces") or ()),
    )


@functools.lru_cache(maxsize=1)
def load_catalogue(path: str | None = None) -> Catalogue:
    """Load the catalogue shipped with the package (or the YAML at `path`)."""
    if path is not None:
        return parse_catalogue(Path(path).read_text())
    text = resources.files("trainspec.schema").joinpath("catalogue.yaml").read_text()
    return parse_catalogue(text)
