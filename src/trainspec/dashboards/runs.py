"""Finding runs under a runs root, telling live ones apart, and a run's headline facts."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from trainspec.dashboards.sql import STEP_VALUE_COLUMNS, finite, nonfinite_count, one_row
from trainspec.store.layout import COMPACT_NAME, is_run_dir

# A run whose newest segment is younger than this, and that is not compacted, is live: its
# writers flush every ~2 s, so 20 s of silence means the job has stopped or stalled.
LIVE_WINDOW_S = 20.0


class DashboardError(ValueError):
    """A runs root or run the dashboard cannot show: the message names the path and why."""


@dataclass(frozen=True)
class RunEntry:
    name: str
    path: Path
    modified: float  # newest segment (or run.duckdb) mtime, unix seconds
    live: bool


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    world_size: int  # from the `runs` rows; 0 when none names it (a run of samples alone)
    ranks: list[int]  # every rank with a runs, steps, samples or events row
    hosts: list[str]
    device: str
    gpus: list[dict] = field(default_factory=list)
    t0: float | None = None  # first timestamp in the run (samples or steps)
    t1: float | None = None
    steps: int = 0
    sample_rows: int = 0
    events: int = 0
    nonfinite: int = 0  # NaN or +-inf values in steps and samples, left out of every figure
    runs_rows: int = 0

    @property
    def span_s(self) -> float:
        return 0.0 if self.t0 is None or self.t1 is None else self.t1 - self.t0

    @property
    def ranks_text(self) -> str:
        """The headline's `ranks seen / world size`, with `?` for a world size no row gave."""
        return f"{len(self.ranks)} / {self.world_size or '?'}"

    def missing_rows_note(self) -> str:
        """Says plainly why the world size is unknown, or "" when a `runs` row gave it."""
        if self.world_size:
            return ""
        if self.runs_rows:
            return ("This run's runs rows name no world size: it is unknown, and its ranks "
                    "are counted from every table.")  # fmt: skip
        if not (self.steps or self.sample_rows or self.events):
            return "This run has no rows yet."
        if self.steps:
            return ("This run has no runs rows: its ranks are counted from their steps, "
                    "samples and events, and its world size is unknown.")  # fmt: skip
        return (f"This run has no runs or steps rows, only {self.sample_rows:,} samples and "
                f"{self.events:,} events rows: its ranks are counted from those, and its "
                "world size is unknown.")  # fmt: skip


def _newest_mtime(run_dir: Path) -> float:
    newest = 0.0
    segments = run_dir / "segments"
    # segments/<table>/<writer>/seg-*.parquet: three levels of scandir, no recursive glob.
    for table in _subdirs(segments):
        for writer in _subdirs(table):
            with os.scandir(writer) as it:
                for entry in it:
                    if entry.name.startswith("seg-"):
                        try:
                            newest = max(newest, entry.stat().st_mtime)
                        except FileNotFoundError:  # a merge removed it since the listing
                            continue
    compact = run_dir / COMPACT_NAME
    if compact.is_file():
        newest = max(newest, compact.stat().st_mtime)
    return newest


def _subdirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def run_entry(run_dir: Path, now: float | None = None) -> RunEntry:
    modified = _newest_mtime(run_dir)
    if modified == 0.0:  # no segment yet: a job that has not flushed, judged by its directory
        with contextlib.suppress(OSError):
            modified = run_dir.stat().st_mtime
    now = time.time() if now is None else now
    live = not (run_dir / COMPACT_NAME).is_file() and now - modified < LIVE_WINDOW_S
    return RunEntry(run_dir.name, run_dir, modified, live)


def list_run_names(root: str | Path) -> tuple[str, ...] | None:
    """The names of the runs under `root` (sorted), or None while `root` is no directory:
    what the page watches every few seconds, so no file of any run is opened or stat-ed."""
    root = Path(root)
    if not root.is_dir():
        return None
    if is_run_dir(root):
        return (root.name,)
    return tuple(sorted(p.name for p in _subdirs(root) if is_run_dir(p)))


def page_is_stale(root: str | Path, shown: tuple[str, ...] | None, picked: RunEntry | None) -> bool:
    """Whether a page that listed `shown` under `root` and drew `picked` must rerun: a run
    appeared or went, or the picked run finished (its sidebar said "still being written" and
    its refresh stayed on until a reload) or, uncompacted, is being written again (a job
    restarted into it). Only the picked run's files are stat-ed, and a compacted run's not."""
    if list_run_names(root) != shown:
        return True
    if picked is None:
        return False
    if not picked.live and (picked.path / COMPACT_NAME).is_file():
        return False
    return run_entry(picked.path).live != picked.live


def list_runs(root: str | Path) -> list[RunEntry]:
    """The runs under `root`, newest first; `root` may itself be one run directory.

    Raises DashboardError when `root` does not exist or is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise DashboardError(f"{root}: no such runs directory")
    if is_run_dir(root):
        return [run_entry(root)]
    found = [run_entry(p) for p in _subdirs(root) if is_run_dir(p)]
    return sorted(found, key=lambda e: (-e.modified, e.name))


def load_summary(con: duckdb.DuckDBPyConnection) -> RunSummary:
    """Identity and extent of the run behind `con` (views from `trainspec.store.open`)."""
    rows = con.execute(
        "SELECT run_id, rank, world_size, host, device, gpus FROM runs ORDER BY rank"
    ).fetchall()
    s0, s1, sn, s_bad = one_row(
        con.execute(
            f"SELECT {finite('min', 'ts')}, {finite('max', 'ts')}, count(*), "
            f"{nonfinite_count(['value'])} FROM samples"
        )
    )
    p0, p1, steps, p_bad = one_row(
        con.execute(
            f"SELECT {finite('min', 'ts')}, {finite('max', 'ts')}, coalesce(max(step) + 1, 0), "
            f"{nonfinite_count(STEP_VALUE_COLUMNS)} FROM steps"
        )
    )
    (events,) = one_row(con.execute("SELECT count(*) FROM events"))
    # A run can hold samples alone (an agent that stored a rank's readings before its runs
    # row, or lost it): their ranks count too, or the headline says 0 ranks for a run with data.
    seen = con.execute(
        "SELECT rank FROM steps UNION SELECT rank FROM samples UNION SELECT rank FROM events"
    ).fetchall()
    ranks = sorted({r[1] for r in rows} | {r for (r,) in seen if r is not None and r >= 0})
    gpus: list[dict] = []
    for row in rows:
        for gpu in _json_list(row[5]):
            gpus.append({"rank": row[1], "host": row[3], **gpu})
    starts = [t for t in (s0, p0) if t is not None]
    ends = [t for t in (s1, p1) if t is not None]
    return RunSummary(
        run_id=rows[0][0] if rows else "",
        world_size=max((r[2] for r in rows if r[2]), default=0),
        ranks=ranks,
        hosts=sorted({r[3] for r in rows if r[3]}),
        device=rows[0][4] if rows else "unknown",
        gpus=gpus,
        t0=min(starts) if starts else None,
        t1=max(ends) if ends else None,
        steps=int(steps or 0),
        sample_rows=int(sn or 0),
        events=int(events or 0),
        nonfinite=int(s_bad or 0) + int(p_bad or 0),
        runs_rows=len(rows),
    )


def _json_list(raw: str | None) -> list[dict]:
    try:
        value = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
