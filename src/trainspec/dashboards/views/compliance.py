"""Compliance: the validator's verdict on the run, its violations one row per metric and
rule shared by several ranks (`trainspec validate --by-rank` lists every one)."""

from __future__ import annotations

import streamlit as st

from trainspec.dashboards.compliance import ComplianceResult, check_run
from trainspec.dashboards.views import ViewContext


@st.cache_data(show_spinner="validating the run...", max_entries=16)
def _cached_check(path: str, modified: float) -> ComplianceResult:
    # Keyed by the newest segment's mtime: a live run is re-judged once it has new data.
    return check_run(path)


def render(ctx: ViewContext) -> None:
    st.subheader("Compliance")
    result = _cached_check(str(ctx.entry.path), ctx.entry.modified)
    if not result.available:
        st.warning("validator not installed")
        return
    if result.error:
        st.error(result.headline)
    elif result.compliant:
        st.success(result.headline)
    else:
        st.error(result.headline)
    for warning in result.warnings:
        st.caption(f"warning: {warning}")
    if ctx.entry.live:
        st.caption("The run is still being written: the verdict covers the data so far.")
    if not result.groups.empty:
        st.dataframe(result.groups, hide_index=True)
