"""The standard: the metric catalogue, its Python model, and the compliance validator.

Contract: `load_catalogue()` returns the versioned catalogue shipped as package data
(`catalogue.yaml`); every metric has an OTel-style name, a derived Prometheus name, a UCUM
unit, an instrument, its attributes, source, true resolution and required interval.
`trainspec.schema.validate` judges runs, Prometheus expositions and OTLP payloads against it.
This package imports nothing else of trainspec and does not import torch.
"""

from __future__ import annotations

from trainspec.schema.catalogue import (
    Catalogue,
    CatalogueError,
    Metric,
    load_catalogue,
)
from trainspec.schema.names import prometheus_name

__all__ = ["Catalogue", "CatalogueError", "Metric", "load_catalogue", "prometheus_name"]
