"""The static report: the dashboard's headline plots as PNG files or one self-contained HTML.

    render_report("runs/abc", html="report.html")   # plots inlined as base64 PNG
    render_report("runs/abc", png_dir="plots/")     # one PNG per plot

For a CI artifact or a paper: no server, matplotlib's Agg canvas only. Raises StoreError
(one line) when the run cannot be read.
"""

from __future__ import annotations

import base64
import contextlib
import html as html_lib
import io
import os
import secrets
from pathlib import Path

import duckdb
import pandas as pd

from trainspec import store
from trainspec.dashboards.compliance import ComplianceResult, check_run
from trainspec.dashboards.data import (
    event_text,
    load_actions,
    load_overview,
    rolled_back,
    rolled_back_text,
)
from trainspec.dashboards.figures import headline_figures
from trainspec.dashboards.skipped import missing_clause, segment_names
from trainspec.dashboards.stragglers import straggler_table
from trainspec.store.errors import first_line
from trainspec.store.layout import COMPACT_NAME

DPI = 110
CSS = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.2em .5em}"
    "img{max-width:100%}"
)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0)


def _stragglers(stragglers: pd.DataFrame) -> str:
    """The slowest ranks first, at most STRAGGLER_ROWS, and a line saying how many more."""
    table = straggler_table(stragglers)
    note = f"<p>{html_lib.escape(table.note)}</p>" if table.note else ""
    return "<h2>Stragglers (slowest ranks first)</h2>" + _table(table.rows) + note


def _compliance_table(verdict: ComplianceResult) -> str:
    """A row per violation, or per metric and rule shared by several ranks: 1,024 ranks
    missing a metric are one row, not 1,024."""
    note = ""
    if len(verdict.groups) < len(verdict.violations):
        note = (
            "<p>One row per metric and rule found on several ranks; "
            "<code>trainspec validate --by-rank</code> lists every violation.</p>"
        )
    return _table(verdict.groups) + note


def _compliance_warnings(verdict: ComplianceResult) -> list[str]:
    """The validator's warnings, as the dashboard's Compliance view lists them."""
    if not verdict.warnings:
        return []
    items = "".join(f"<li>warning: {html_lib.escape(w)}</li>" for w in verdict.warnings)
    return [f"<ul class='warnings'>{items}</ul>"]


def _events_table(events: pd.DataFrame) -> pd.DataFrame:
    """The events as the report lists them: an empty cell where the evidence, before or
    after JSON is NULL (an anomaly changes nothing), never `NaN`; `rolled back` names the
    step a later attempt resumed from, for an action that attempt undid."""
    cols = ["step", "kind", "name", "severity", "reason", "evidence", "before", "after"]
    table = events[cols].copy()
    for col in ("evidence", "before", "after"):
        table[col] = [event_text(v) or "" for v in table[col]]
    table["rolled back"] = [rolled_back_text(v) for v in rolled_back(events)]
    return table


def _actions_section(events: pd.DataFrame) -> str:
    """The anomalies and actions table, with a line on the actions a restart rolled back."""
    undone = sum(1 for v in rolled_back(events) if rolled_back_text(v))
    note = ""
    if undone:
        note = (
            f"<p>{undone} action(s) marked <em>rolled back</em>: made by an attempt of the job "
            "that was restarted from an earlier checkpoint (their step is past the step it "
            "resumed from), so they were undone; what the later attempt decided is listed "
            "as well.</p>"
        )
    return "<h2>Anomalies and actions</h2>" + note + _table(_events_table(events))


def _stored_places(run: Path) -> list[Path]:
    """The files and folders holding the stored data of `run` (a run directory or a
    .duckdb file): a file given by name, and the run directory holding it."""
    root = run.resolve()
    places: list[Path] = []
    if root.is_file():  # a run.duckdb, or a compacted file under any name
        places += [root, root.with_name(root.name + ".wal")]
        if root.name != COMPACT_NAME and not (root.parent / "segments").is_dir():
            return places  # a lone .duckdb file: its folder is not a run directory
        root = root.parent
    compact_file = root / COMPACT_NAME
    return places + [compact_file, compact_file.with_name(COMPACT_NAME + ".wal"), root / "segments"]


def _check_outside_store(run: Path, target: Path) -> None:
    """StoreError for an output path that is stored data: a report written over a
    `run.duckdb` or into `segments/` destroyed what it reported on. Protected: the run given
    (a directory, or a .duckdb file and the run directory holding it) and any run directory
    the output would land in."""
    out = target.resolve()
    stored = _stored_places(run)
    for parent in out.parents:  # the output inside another run: RUN/segments/..., RUN/run.duckdb
        if (parent / "segments").is_dir() or (parent / COMPACT_NAME).is_file():
            stored += _stored_places(parent)
    for place in stored:
        if out == place or place in out.parents:
            raise store.StoreError(
                f"{target}: inside the run's stored data; write the report elsewhere"
            )


def _write_replacing(target: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `target` and rename it over `target`: a report
    that fails leaves no half-written file, and a `target` that is a hard link to stored data
    is replaced, never written through. A symbolic link is followed (its target is replaced).
    A target that is no regular file (`/dev/null`, `/dev/stdout`, a FIFO) is written to: a
    rename over it made `/dev/null` a regular file, for every process of the machine."""
    final = target.resolve()
    if final.exists() and not final.is_file() and not final.is_dir():
        with open(final, "wb") as f:
            f.write(data)
        return
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:  # creating the temporary file fails too (a read-only or pseudo file system)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.strerror:  # name the destination, not the tmp file
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        raise


def _html(run: Path, overview, actions, pngs: dict[str, bytes], skipped: list | tuple = ()) -> str:
    s = overview.summary
    esc = html_lib.escape
    facts = pd.DataFrame(
        [
            ("run", s.run_id or run.name),
            ("ranks", f"{len(s.ranks)} of world size {s.world_size or 'unknown (no runs rows)'}"),
            ("hosts", ", ".join(s.hosts)),
            ("device", s.device),
            ("steps", s.steps),
            ("samples rows", s.sample_rows),
            ("span (s)", f"{s.span_s:.1f}"),
            ("NaN or infinite values (left out of the figures)", s.nonfinite),
        ],
        columns=["", "value"],
    )
    verdict = check_run(run)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>trainspec report: "
        f"{esc(run.name)}</title><style>{CSS}</style></head><body>",
        f"<h1>trainspec report: {esc(run.name)}</h1>",
        _table(facts),
        f"<h2>Compliance</h2><p>{esc(verdict.headline)}</p>",
        *_compliance_warnings(verdict),
    ]
    if skipped:
        names = esc(segment_names(skipped, shown=None))
        clause = esc(missing_clause(skipped, "every figure below"))
        parts.insert(2, f"<p><strong>{len(skipped)} segment(s) could not be read; {clause}:"
                        f"</strong> {names}</p>")  # fmt: skip
    if not verdict.groups.empty:
        parts.append(_compliance_table(verdict))
    parts.append(_stragglers(overview.stragglers))
    for name, data in pngs.items():
        b64 = base64.b64encode(data).decode("ascii")
        parts.append(f"<h2>{esc(name.replace('_', ' '))}</h2><img alt='{esc(name)}' "
                     f"src='data:image/png;base64,{b64}'>")  # fmt: skip
    if not actions.events.empty:
        parts.append(_actions_section(actions.events))
    parts.append("</body></html>")
    return "\n".join(parts)


def render_report(
    run: str | Path, *, html: str | Path | None = None, png_dir: str | Path | None = None
) -> list[Path]:
    """Write the report; returns the files written. Raises StoreError for an unreadable run."""
    run = Path(run)
    for target in (html, png_dir):
        if target is not None:
            _check_outside_store(run, Path(target))
    con = store.open(run)
    try:
        overview, actions = load_overview(con), load_actions(con)
        skipped = store.skipped_segments(con)
    except duckdb.Error as exc:  # corrupt data behind a readable footer, a truncated file...
        raise store.StoreError(f"{run}: cannot read: {first_line(exc)}") from exc
    finally:
        con.close()
    if overview.summary.steps == 0 and overview.summary.sample_rows == 0:
        raise store.StoreError(f"{run}: the run holds no steps and no samples")
    pngs = {name: _png(fig) for name, fig in headline_figures(overview, actions).items()}
    png_files = (
        {name: Path(png_dir) / f"{name}.png" for name in pngs} if png_dir is not None else {}
    )
    for path in png_files.values():  # each file: one may be a symbolic link into a run
        _check_outside_store(run, path)
    written: list[Path] = []
    if png_dir is not None:
        Path(png_dir).mkdir(parents=True, exist_ok=True)
        for name, path in png_files.items():
            _write_replacing(path, pngs[name])
            written.append(path)
    if html is not None:
        target = Path(html)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_replacing(target, _html(run, overview, actions, pngs, skipped).encode("utf-8"))
        written.append(target)
    return written
