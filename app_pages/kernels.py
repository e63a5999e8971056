"""Kernels: a run's GPU kernels, by name or by the operator that launched them, and each GPU's utilization, SM
efficiency and achieved occupancy per step with their definitions."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof import charts
from dpprof.views import kernels

KEPT_KEY = "kernels_kept"  # session state: the grouping and search last chosen (no widget has this key)


def body(row: pd.Series) -> None:
    common.run_header(row)
    capture = common.capture_box(row)  # the capture kept from another page may be one without them: said so
    missing = common.view(kernels.missing_text, row, capture=capture)
    if missing:
        common.missing(missing)
        return
    picks = common.view(kernels.picks, row, capture=capture)
    c1, c2, c3 = st.columns([2, 2, 3])
    with c1:
        pick = common.pick_box("Rank and device", picks, "k_pick")
    # kept beside the widgets: Streamlit drops a widget's state while another page is open
    kept = st.session_state.setdefault(KEPT_KEY, {"by": "name", "search": ""})
    by = c2.radio("Group by", ["name", "operator"], index=["name", "operator"].index(kept["by"]), horizontal=True,
                  key="k_by", format_func={"name": "kernel", "operator": "kernel + operator"}.get)
    search = c3.text_input("Search names", value=kept["search"], key="k_search")
    kept.update(by=by, search=search)
    data = common.view(kernels.kernels_page, row, pick, by, search, capture=capture)
    st.subheader("GPU utilization, SM efficiency and occupancy")
    common.table(data.summary, "gpu_summary")
    if data.per_step.empty:
        common.missing("No step of this run has kernels in it: the figures per step need steps (ProfilerStep#N).")
    else:
        common.chart(charts.gpu_metrics_per_step(data.per_step))
    with st.expander("What these figures mean (the TensorBoard profiler plugin's definitions)", expanded=True):
        st.markdown("\n".join(f"- **{name}**: {text}" for name, text in kernels.GPU_METRIC_DEFINITIONS.items()))
    st.subheader("Kernels")
    table = data.table
    st.caption(f"{len(table):,} rows, by total time. Blocks per SM and occupancy are means weighted by duration "
               "(Kineto's figures, or computed from grid, block, registers, shared memory and deviceProperties); "
               "tensor cores: the kernel's name says it runs on them. Click a header to sort.")
    common.table(table, f"kernels_{by}")


common.live(body)
