"""Compare: two or more runs side by side (step time, phase shares, per-device memory) and what differs."""
from __future__ import annotations

import streamlit as st

from dpprof import charts, views
from app_pages import common

st.title("Compare runs")
runs = common.readable(common.listing())
ids = runs["id"].tolist()
labels = dict(zip(ids, (common.run_label(r) for _, r in runs.iterrows())))
state = st.session_state
if "compare_pick" not in state:  # first visit, or the Runs page chose the runs
    state["compare_pick"] = [i for i in state.get(common.COMPARE_KEY, []) if i in ids] or ids[:2][::-1]
state["compare_pick"] = [i for i in state["compare_pick"] if i in ids]  # a run file may have gone
chosen = st.multiselect("Runs (the first is the baseline)", ids, format_func=labels.get, key="compare_pick")
state[common.COMPARE_KEY] = chosen


def body() -> None:
    if len(chosen) < 2:
        common.missing("Choose two or more runs to compare (here, or select them on the Runs page)."
                       if len(ids) >= 2 else "Comparing needs two or more runs; record another on the New run page.")
        return
    rows = [runs[runs["id"] == i].iloc[0] for i in chosen]
    data = views.combine([common.view("compare_part", r) for r in rows])
    st.subheader("What differs")
    st.caption(f"Against the baseline, {data.summary.iloc[0]['run']}.")
    st.markdown("\n".join(f"- {line}" for line in data.differences) or "Nothing to compare yet.")
    summary = data.summary.set_index("run").T
    shown = summary.map(lambda v: f"{v:,.2f}" if isinstance(v, float) else "" if v is None else str(v))
    common.table(shown, "compare_summary", index=True)
    common.chart(charts.compare_step_times(data.steps))
    left, right = st.columns(2)
    with left:
        common.chart(charts.compare_phase_shares(data.shares))
    with right:
        if data.memory.empty:  # imported traces: no dpprof accounting per device (the allocator's is on Per-GPU load)
            common.missing("None of these runs has dpprof's per-device memory accounting (imported traces have "
                           "none): there is no memory to compare.")
        else:
            common.chart(charts.compare_memory(data.memory))
    if data.memory["peak_allocated_bytes"].isna().any():
        st.caption("Memory is what dpprof accounts to each device (chunk, outputs, activations, gathered outputs, "
                   "weights): some of these runs have no CUDA allocator figures.")


common.refreshing(bool((runs[runs["id"].isin(chosen)]["status"] == "running").any()), body)
