"""Per-GPU load: apply time per device, memory per device, chunk sizes, and the GPUs over time."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from app_pages import common


def body(row: pd.Series) -> None:
    common.run_header(row)
    data = common.view("load", row)

    st.subheader(f"{data.work_phase.capitalize()} time per device")
    if "apply" in data.missing:
        common.missing(data.missing["apply"])
    else:
        kind = st.segmented_control("Draw as", ["box", "violin"], default="box", key="apply_kind") or "box"
        common.chart(charts.apply_distribution(data.apply_samples, kind, data.work_phase, data.idle))
        if data.apply_stats["sampled"].any():
            per = int(data.apply_samples.groupby("device").size().max())
            st.caption(f"The distributions and percentiles use every k-th step ({per:,} per device); mean, min and "
                       "max are over every step.")
        common.table(data.apply_stats.drop(columns=["sampled"]), "apply_per_device")
    if data.idle:
        st.caption(f"{', '.join(data.idle)} got no chunk in any step: idle, drawn at zero.")

    st.subheader("Memory per device")
    if "memory" in data.missing:
        common.missing(data.missing["memory"])
    else:
        common.chart(charts.memory_per_device(data.memory, data.idle))
        if "allocator" in data.missing:
            common.missing(data.missing["allocator"])
        out = data.memory.loc[data.memory["output_device"].astype(bool), "device"].tolist()
        if out:
            st.caption(f"{out[0]} is the output device: the gathered outputs (and the loss) live there.")
        common.table(data.memory, "memory_per_device")

        st.subheader("Chunk sizes")
        common.chart(charts.chunk_sizes(data.chunks, data.idle))
        common.table(data.chunks, "chunk_sizes")

    st.subheader("GPUs over time")
    if "gpu" in data.missing:
        common.missing(data.missing["gpu"])
    else:
        common.chart(charts.gpu_samples(data.gpu))
        common.table(data.gpu, "gpu_samples_bucketed")


def trace_gpu_time(row: pd.Series) -> None:
    """An imported trace's GPU time per device (its Distributed view); nothing for a recorded run."""
    per = common.view("gpu_time", row)
    if per.empty:
        return
    st.subheader("GPU time per device (from the trace)")
    common.chart(charts.gpu_time(per))
    common.table(per.round(3), "gpu_time_per_device")


def _body(row: pd.Series) -> None:
    body(row)
    trace_gpu_time(row)


common.live(_body)
