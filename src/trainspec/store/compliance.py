"""`validate_target`: judge any target against the catalogue, runs included.

Runs are read through the store (`store.target.read_run`); expositions and OTLP payloads by
`trainspec.schema.targets`. The rules themselves are the schema's (`schema.validate.judge`).
"""

from __future__ import annotations

from pathlib import Path

from trainspec.schema import Catalogue, load_catalogue
from trainspec.schema.validate import Report, judge, validate_payload


def validate_target(target: str | Path, catalogue: Catalogue | None = None) -> Report:
    """Read and judge a target; raises TargetError (one line) when it cannot be read."""
    from trainspec.store.target import read_run

    catalogue = catalogue or load_catalogue()
    text = str(target)
    path = Path(text)
    if not text.startswith(("http://", "https://")) and (path.is_dir() or path.suffix == ".duckdb"):
        return judge(read_run(path, catalogue), catalogue)
    return validate_payload(text, catalogue)
