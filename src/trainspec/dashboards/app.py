"""The Streamlit app: `trainspec dashboard RUN_ROOT` runs `streamlit run` on this file.

The runs root comes from the environment (`TRAINSPEC_DASHBOARD_ROOT`, set by the CLI) or
the first script argument. The selected view re-renders every `REFRESH_S` seconds while
"live refresh" is on (the default for a run still being written; a toggle per run): each
pass opens fresh DuckDB views over the run's Parquet segments, so new segments appear and the
writers are never touched. The runs root is listed again every `REFRESH_S` seconds, live
refresh or not: a run started while the page is open (or under a root that had none) appears
on its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import duckdb
import streamlit as st

from trainspec import store
from trainspec.dashboards.runs import (
    DashboardError,
    RunEntry,
    list_runs,
    page_is_stale,
    run_entry,
)
from trainspec.dashboards.skipped import skipped_warning
from trainspec.dashboards.views import VIEW_NAMES, ViewContext, view
from trainspec.store.errors import first_line

ROOT_ENV = "TRAINSPEC_DASHBOARD_ROOT"
REFRESH_S = 2.0
POINTS = 600


def runs_root() -> Path:
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    return Path(args[0]) if args else Path("runs")


def _label(entry: RunEntry) -> str:
    return f"● {entry.name} (live)" if entry.live else entry.name


def sidebar(runs: list[RunEntry]) -> tuple[RunEntry, str, bool]:
    st.sidebar.title("trainspec")
    # The options are the run names, shown as they are: Streamlit keeps a pick by its shown
    # text, and a label that said "(live)" changed when the run finished, so the next rerun
    # (every new run makes one) jumped to the newest run. Liveness is said below instead.
    by_name = {e.name: e for e in runs}
    picked = st.sidebar.selectbox("run", list(by_name), key="run")
    entry = by_name.get(picked or "", runs[0])
    if entry.live:
        st.sidebar.caption(f"{_label(entry)}: still being written")
    name = st.sidebar.radio("view", VIEW_NAMES, key="view") or VIEW_NAMES[0]
    # A toggle per run: one key for every run kept the first run's setting, so picking a
    # live run left refresh off. Each run's toggle starts at "is it live", then keeps what
    # the user set for that run while it stays picked.
    # The key says whether the run is live too: once it finishes, the toggle starts again at
    # off (it kept refreshing a finished run every REFRESH_S until the page was reloaded).
    state = "live" if entry.live else "finished"
    live = st.sidebar.toggle(
        f"live refresh ({REFRESH_S:g} s)", value=entry.live, key=f"live:{entry.path}:{state}"
    )
    return entry, name, live


def _warn_skipped(skipped: list[tuple[str, str]], slot: Any) -> None:
    """On every view, in `slot` above it: figures drawn without an unreadable segment's rows
    say so. Filled after the view drew: damage is found while its queries read."""
    if skipped:
        slot.warning(skipped_warning(skipped))


@st.fragment(run_every=REFRESH_S)
def watch_runs(root: Path, shown: tuple[str, ...] | None, picked: RunEntry | None = None) -> None:
    """Every REFRESH_S, whatever the live toggle: a run that appeared (or went) under `root`
    since the page listed `shown` reruns the whole page, so the picker lists it and the
    "no runs yet" page gives way to the run; so does the picked run once it finishes or is
    written again (`page_is_stale`). Draws nothing."""
    if page_is_stale(root, shown, picked):
        st.rerun()


def render_view(entry: RunEntry, name: str, runs: list[RunEntry]) -> None:
    fresh = run_entry(entry.path)  # newest mtime: a live run's caches key on it
    for attempt in range(2):
        try:
            con = store.open(fresh.path)
        except store.StoreError as exc:
            st.error(str(exc))
            return
        try:
            slot = st.empty()
            view(name)(ViewContext(con=con, entry=fresh, runs=runs, points=POINTS))
            _warn_skipped(store.skipped_segments(con), slot)
            return
        except store.StoreError as exc:  # a view that opens another run (Compare)
            st.error(str(exc))
            return
        except duckdb.Error as exc:
            # An IOException may be a writer's merge removing a segment after we listed it:
            # list again, once. Anything else (a corrupt page, a truncated file) is shown.
            if attempt == 1 or not isinstance(exc, duckdb.IOException):
                st.error(f"{fresh.path}: cannot read: {first_line(exc)}")
                return
        finally:
            con.close()


def main() -> None:
    st.set_page_config(page_title="trainspec dashboard", layout="wide")
    root = runs_root()
    try:
        runs = list_runs(root)
    except DashboardError as exc:
        st.error(str(exc))
        watch_runs(root, None)
        return
    names = tuple(sorted(e.name for e in runs))
    if not runs:
        watch_runs(root, names)
        st.info(f"No runs under {root} yet. Start one with `trainspec demo --out {root}`.")
        return
    entry, name, live = sidebar(runs)
    watch_runs(root, names, entry)
    st.sidebar.caption(f"runs root: {root}")

    @st.fragment(run_every=REFRESH_S if live else None)
    def body() -> None:
        render_view(entry, name, runs)

    body()


main()
