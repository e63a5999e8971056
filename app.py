"""dpprof's dashboard: ``streamlit run app.py``.

For now one page: record a short demo on CPU workers and show where each device spent
its time. Everything below is layout; the work is done by dpprof.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

import dpprof
from dpprof.analysis import phase_table
from dpprof.workloads import WORKLOADS, build_workload, train

st.set_page_config(page_title="dpprof", layout="wide")


@st.cache_data(show_spinner="Recording a demo run on CPU workers…")
def demo_frames(workload: str, workers: int, batch_size: int, steps: int) -> dict[str, pd.DataFrame]:
    run = train(build_workload(workload, batch_size), dpprof.cpu_devices(workers), steps,
                name=f"demo-{workload}")
    return run.frames()


st.title("dpprof — where a data-parallel step spends its time, device by device")
st.caption("A short training run of a built-in workload under dpprof.DataParallel on CPU worker "
           "threads, the same phases a multi-GPU box runs: scatter, replicate, parallel_apply "
           "(each replica's apply on its device), gather, backward.")

with st.sidebar:
    workload = st.selectbox("Workload", list(WORKLOADS), index=list(WORKLOADS).index("cifar-lenet"))
    workers = st.slider("CPU workers", 1, 8, 2)
    batch_size = st.number_input("Batch size", 1, 4096, 256 if workload == "cifar-lenet" else 30)
    steps = st.slider("Steps", 2, 100, 20)

frames = demo_frames(workload, workers, int(batch_size), steps)
steps_df, memory = frames["steps"], frames["memory"]

c1, c2, c3 = st.columns(3)
c1.metric("Steps recorded", len(steps_df))
c2.metric("Median step", f"{steps_df['duration_ms'].median():.1f} ms")
c3.metric("Devices used", int(steps_df["devices_used"].max()))

st.subheader("Mean time per step of each phase, per device (ms)")
st.dataframe(phase_table(frames["phases"]).round(3), width="stretch")

st.subheader("Memory per device (mean per step, bytes)")
st.dataframe(memory.groupby("device")[["chunk_size", "input_bytes", "output_bytes", "activation_bytes",
                                        "gathered_bytes", "param_bytes"]].mean().round(0),
             width="stretch")
