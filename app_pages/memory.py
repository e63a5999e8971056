"""Memory: allocated and reserved memory over time per device with each peak and its step, the memory events
and memory per operator."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof import charts
from dpprof.plaintext import markdown_text
from dpprof.views import memory


def body(row: pd.Series) -> None:
    common.run_header(row)
    capture = common.capture_box(row)  # the capture kept from another page may be one without them: said so
    missing = common.view(memory.missing_text, row, capture=capture)
    if missing:
        common.missing(missing)
        return
    pick = common.pick_box("Rank and device", common.view(memory.picks, row, capture=capture), "mem_pick")
    data = common.view(memory.memory_page, row, pick, capture=capture)
    st.markdown("\n".join(f"- {markdown_text(line)}" for line in memory.peak_lines(data.peaks)))
    common.chart(charts.memory_over_time(data.curve, data.peaks))
    st.caption("Allocated: Total Allocated of the trace's [memory] events (else the running sum of their Bytes); "
               "reserved: Total Reserved, what the caching allocator holds. Each point is the largest value of its "
               "bucket of time, so the peak is never lost.")
    common.table(data.peaks, "memory_peaks")
    st.subheader("Memory events")
    if data.events.empty:
        common.missing("No allocation in this trace names an address (Addr): allocations cannot be paired with "
                       "their frees.")
    else:
        st.caption(f"The {len(data.events):,} largest allocations, each paired with the next free of its address: "
                   "the operator that made it, its size, when, and how long it lived (empty: not freed in the trace).")
        common.table(data.events, "memory_events")
    st.subheader("Memory per operator")
    if data.per_operator.empty:
        common.missing("No allocation in this trace is paired with an operator.")
    else:
        common.table(data.per_operator, "operator_memory")


common.live(body)
