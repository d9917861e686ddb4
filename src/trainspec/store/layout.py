"""Where a run's files live, and how segment names encode the range they cover.

    RUN_DIR/segments/<table>/<writer>/seg-<first>-<last>.parquet
    RUN_DIR/run.duckdb                       (after `trainspec compact`)

`first` and `last` are the writer's own sequence numbers: a fresh segment covers one number,
a merged one the whole range it replaced. Temporary files start with '.' and are never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trainspec.config_rules import is_run_id

SEGMENT_NAME = re.compile(r"^seg-(\d{10})-(\d{10})\.parquet$")
COMPACT_NAME = "run.duckdb"


@dataclass(frozen=True, order=True)
class SegmentFile:
    first: int
    last: int
    path: Path

    @property
    def span(self) -> int:
        return self.last - self.first + 1

    def covers(self, other: SegmentFile) -> bool:
        return self.first <= other.first and other.last <= self.last and self != other


def check_run_id(run_id: str) -> str:
    """A run id is a directory name under the store root: no separators, no dot-dot."""
    if not isinstance(run_id, str):
        raise TypeError(f"run id must be a string, not {type(run_id).__name__} {run_id!r}")
    if not is_run_id(run_id):
        raise ValueError(f"run id {run_id!r} is not a plain directory name")
    return run_id


def sql_path(path: Path) -> str:
    """`path` as a SQL string literal: a run under `~/bob's runs/` must not end the string."""
    return "'" + path.as_posix().replace("'", "''") + "'"


def parquet_path(path: Path) -> str:
    """`path` as a SQL string literal for `read_parquet`, which reads every path it is given
    as a glob pattern: a run under `runs/exp*` also read the segments of `runs/exp-2`, and
    compaction stored them. `*`, `?` and `[` are matched literally as one-character
    classes (`[*]`), which DuckDB's glob takes."""
    return "'" + glob_literal(path).replace("'", "''") + "'"


def glob_literal(path: Path) -> str:
    """`path` as a DuckDB glob pattern that matches only itself (see `parquet_path`)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path.as_posix())


def segment_name(first: int, last: int) -> str:
    return f"seg-{first:010d}-{last:010d}.parquet"


def run_dir_of(segment: Path) -> Path | None:
    """The run directory a segment file lies in (RUN_DIR/segments/<table>/<writer>/seg-...),
    or None for a path not shaped like one."""
    if not SEGMENT_NAME.match(segment.name) or len(segment.parents) < 4:
        return None
    run_dir = segment.parents[3]
    return run_dir if segment.parents[2].name == "segments" else None


def segments_dir(run_dir: Path, table: str, writer: str | None = None) -> Path:
    base = run_dir / "segments" / table
    return base / writer if writer is not None else base


def list_writer_segments(writer_dir: Path) -> list[SegmentFile]:
    """The visible segments of one writer: files another file's range covers are dropped."""
    found: list[SegmentFile] = []
    try:
        entries = list(writer_dir.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        m = SEGMENT_NAME.match(entry.name)
        if m:
            found.append(SegmentFile(int(m.group(1)), int(m.group(2)), entry))
    return visible(found)


def visible(found: list[SegmentFile]) -> list[SegmentFile]:
    """`found` without the files another one's range covers, in order. A merge renames its
    output into place before deleting its inputs: the widest is kept. One sort and one sweep
    (first ascending, the wider of a shared first ahead): a file is covered exactly when an
    earlier one reaches as far, so a writer whose merges stalled lists thousands of files in
    milliseconds, where comparing every pair took seconds."""
    out: list[SegmentFile] = []
    reach = -1
    for seg in sorted(found, key=lambda s: (s.first, -s.last, s.path)):
        if seg.last > reach:
            out.append(seg)
            reach = seg.last
    return out


def holds_writer(run_dir: Path, writer: str) -> bool:
    """Whether an earlier process already stored rows as `writer` here (its run row, in a
    segment or in a compacted run.duckdb)."""
    if (run_dir / COMPACT_NAME).exists():
        return True
    return bool(list_writer_segments(segments_dir(run_dir, "runs", writer)))


def list_table_segments(run_dir: Path, table: str) -> list[SegmentFile]:
    base = segments_dir(run_dir, table)
    if not base.is_dir():
        return []
    out: list[SegmentFile] = []
    for writer_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        out.extend(list_writer_segments(writer_dir))
    return out


def is_run_dir(path: Path) -> bool:
    return (path / "segments").is_dir() or (path / COMPACT_NAME).is_file()
