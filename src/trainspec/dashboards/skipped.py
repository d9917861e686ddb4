"""What a figure drawn without unreadable segments lacks, said the way the CLI says it.

A run directory holding a readable `run.duckdb` beside its segments is read as the segments
plus the compacted rows no segment holds (`store.open`): a damaged segment's rows are then
in every figure whenever a compaction folded them in. Only where no readable `run.duckdb`
lies beside the segments are their rows surely missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainspec.store.layout import COMPACT_NAME, run_dir_of

SHOWN = 3  # segment names spelled out in a warning; the rest are counted


def compacted_copy(skipped: Sequence[tuple[str, str]]) -> Path | None:
    """The readable `run.duckdb` beside the skipped segments that may hold their rows, or
    None: no such file, or it is itself among the files found damaged."""
    paths = [Path(path) for path, _ in skipped]
    damaged = {p.resolve() for p in paths}
    for path in paths:
        run_dir = run_dir_of(path)
        base = run_dir / COMPACT_NAME if run_dir is not None else None
        if base is not None and base.is_file() and base.resolve() not in damaged:
            return base
    return None


def missing_clause(skipped: Sequence[tuple[str, str]], where: str = "every figure") -> str:
    """`their rows are missing from {where}`, `... unless run.duckdb holds them` where a
    readable compacted copy may have supplied them."""
    base = compacted_copy(skipped)
    unless = f" unless {base.name} holds them" if base is not None else ""
    return f"their rows are missing from {where}{unless}"


def segment_names(skipped: Sequence[tuple[str, str]], shown: int | None = SHOWN) -> str:
    """The skipped files' names, the first `shown` of them (all with None) and a count."""
    names = [Path(path).name for path, _ in skipped]
    listed = names if shown is None else names[:shown]
    more = f" and {len(names) - len(listed)} more" if len(names) > len(listed) else ""
    return ", ".join(listed) + more


def skipped_warning(
    skipped: Sequence[tuple[str, str]], *, run: str = "", where: str = "every figure"
) -> str:
    """One line for the app: how many segments of `run` (named when given) could not be
    read, what that leaves out of `where`, and which; empty when none were skipped."""
    if not skipped:
        return ""
    of_run = f" of {run}" if run else ""
    return (
        f"{len(skipped)} segment(s){of_run} could not be read; "
        f"{missing_clause(skipped, where)}: {segment_names(skipped)}"
    )
