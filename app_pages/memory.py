"""Memory: allocated and reserved memory over time per device with each peak and its step, the memory events
and memory per operator."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof import charts
from dpprof.plaintext import markdown_text
from dpprof.views import memory
from dpprof.views.opdiff import Pick


def body(row: pd.Series) -> None:
    common.run_header(row)
    missing = common.view(memory.missing_text, row)
    if missing:
        common.missing(missing)
        return
    all_peaks = common.view(memory.peaks, row, Pick())
    picks = [Pick(int(r), str(d)) for r, d in all_peaks[["rank", "device"]].itertuples(index=False, name=None)]
    pick = common.pick_box("Rank and device", picks, "mem_pick")
    peaks = common.view(memory.peaks, row, pick)
    st.markdown("\n".join(f"- {markdown_text(line)}" for line in memory.peak_lines(peaks)))
    curve = common.view(memory.memory_curve, row, pick)
    common.chart(charts.memory_over_time(curve, peaks))
    st.caption("Allocated: Total Allocated of the trace's [memory] events (else the running sum of their Bytes); "
               "reserved: Total Reserved, what the caching allocator holds. Each point is the largest value of its "
               "bucket of time, so the peak is never lost.")
    common.table(peaks, "memory_peaks")
    st.subheader("Memory events")
    events = common.view(memory.events, row, pick)
    if events.empty:
        common.missing("No allocation in this trace names an address (Addr): allocations cannot be paired with "
                       "their frees.")
    else:
        st.caption(f"The {len(events):,} largest allocations, each paired with the next free of its address: the "
                   "operator that made it, its size, when, and how long it lived (empty: not freed in the trace).")
        common.table(events, "memory_events")
    st.subheader("Memory per operator")
    per_op = common.view(memory.per_operator, row, pick)
    if per_op.empty:
        common.missing("No allocation in this trace is paired with an operator.")
    else:
        common.table(per_op, "operator_memory")


common.live(body)
