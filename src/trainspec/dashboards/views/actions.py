"""Actions: anomalies, actions, faults and checkpoints on a timeline over step time."""

from __future__ import annotations

import streamlit as st

from trainspec.dashboards import charts
from trainspec.dashboards.data import (
    event_ranks,
    event_text,
    load_actions,
    rolled_back,
    rolled_back_text,
)
from trainspec.dashboards.views import ViewContext


def render(ctx: ViewContext) -> None:
    data = load_actions(ctx.con, ctx.points)
    st.subheader("Actions and anomalies")
    if data.timeline.empty and data.events.empty:
        st.info("This run has no steps or events yet.")
        return
    st.altair_chart(charts.event_timeline(data.timeline, data.events), width="stretch")
    if data.events.empty:
        st.info("No anomalies or actions recorded in this run.")
        return
    counts = data.events.groupby("kind").size()
    st.caption(", ".join(f"{n} {kind}" for kind, n in counts.items()))
    undone = [rolled_back_text(v) for v in rolled_back(data.events)]
    for ev, rolled in zip(data.events.itertuples(), undone, strict=True):
        label = f"step {ev.step} · {ev.kind} · {ev.name} · {ev.severity}: {ev.reason}"
        if rolled:  # an action of an attempt a restart undid (`load_actions`)
            label += f" · rolled back ({rolled.removeprefix('yes: ')})"
        with st.expander(label):
            st.write(f"ranks {event_ranks(ev.ranks)}, {ev.t:.1f} s after the run started")
            st.markdown("**Evidence**")
            st.code(event_text(ev.evidence) or "{}", language="json")
            before, after = event_text(ev.before), event_text(ev.after)
            if before is not None or after is not None:  # an action's change; anomalies have none
                left, right = st.columns(2)
                left.markdown("**Before**")
                left.code(before or "", language="json")
                right.markdown("**After**")
                right.code(after or "", language="json")
