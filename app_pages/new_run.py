"""New run: start a built-in workload in a background process, then watch it record (and stop it)."""
from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from dpprof.workloads import WORKLOADS
from app_pages import common

st.title("New run")
st.caption("Trains a built-in workload under dpprof.DataParallel in its own process "
           "(`python -m dpprof profile …`), so the dashboard stays responsive; its pages refresh by themselves "
           "while it records. A run starts only from the Start button.")
names = list(WORKLOADS)
# plain widgets, no st.form: Enter in a field never submits anything
workload = st.selectbox("Workload", names, index=names.index("cifar-lenet"), key="nr_workload")
choices = ["CPU workers"] + (["every CUDA GPU"] if torch.cuda.is_available() else [])
on = st.radio("Devices", choices, horizontal=True, key="nr_devices")
c1, c2, c3 = st.columns(3)
workers = int(c1.number_input("CPU workers", min_value=1, max_value=64, value=2, key="nr_workers"))
steps = int(c2.number_input("Steps", min_value=1, max_value=10_000_000, value=50, key="nr_steps"))
batch = int(c3.number_input("Batch size (0: the workload's own)", min_value=0, max_value=1_000_000, value=0,
                            key="nr_batch"))
name = st.text_input("Name (optional)", max_chars=100, key="nr_name")
balanced = st.checkbox("Balanced: DataParallelModel + DataParallelCriterion (each device computes its share of the "
                       "loss; nothing is gathered onto one device)", key="nr_balanced")
capture = st.text_input("Capture steps A:B with torch.profiler (optional: steps A to B-1, their operators stored "
                        "per device and the raw trace kept for Perfetto)", max_chars=24, key="nr_capture")
busy = common.running_processes()
confirmed = True
if busy:
    confirmed = st.checkbox(f"Start another run while {len(busy)} started here is still running (they share this "
                            "machine's cores and slow each other down)", key=f"nr_confirm_{max(busy)}")
if st.button("Start", type="primary", key="nr_start", disabled=not confirmed):
    devices = f"cpu:{workers}" if on == "CPU workers" else "cuda"
    if common.start_run(workload, devices, steps, batch or None, name.strip() or None, balanced=balanced,
                        capture=capture.strip() or None):
        st.rerun()  # draw the page again with the run going: a second start now asks first
    # else the reason stays on the page (a bad capture window, a reports directory that cannot be written)
common.watch_started_run()

mine = [p for p in st.session_state.get("started", []) if p in common.processes()]
if mine:
    st.subheader("Started from this page")
    rows = []
    for pid in reversed(mine):
        status, code = common.process_status(pid)
        rows.append({"pid": pid, "process": status if code is None else f"exited ({code})",
                     "command": " ".join(common.processes()[pid].cmd[3:])})
    st.dataframe(pd.DataFrame(rows), hide_index=True)
