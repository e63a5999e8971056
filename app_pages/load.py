"""Per-GPU load: each device's work per step, its memory, its chunks, its GPU over time and GPU time by kind of
work, each section drawn where the run has its data and said in words where it does not."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from dpprof.plaintext import capitalized, markdown_text
from dpprof.views import load
from app_pages import common

DRAW_AS_KEY = "load_draw_as"  # session state: box or violin, as last chosen (no widget has this key)


def body(row: pd.Series) -> None:
    common.run_header(row)
    data = common.view(load.load, row)
    model = data.model
    if model.kind == "empty":
        return
    work = model.work.label
    st.subheader(markdown_text(f"{capitalized(work)} time per {model.unit}"))
    if data.work_stats.empty:
        common.missing(data.missing.get("work") or f"No {work} phases recorded.")
    else:
        # kept beside the widget: Streamlit drops a widget's state while another page is open
        kind = st.segmented_control("Draw as", ["box", "violin"], default=st.session_state.get(DRAW_AS_KEY, "box"),
                                    key="apply_kind") or "box"
        st.session_state[DRAW_AS_KEY] = kind
        common.chart(charts.work_distribution(data.work_samples, kind, work, data.idle, unit_word=model.unit))
        if model.aggregated:
            per = int(data.work_samples.groupby("device").size().max()) if len(data.work_samples) else 0
            st.caption(f"The distributions use {per:,} steps per {model.unit}: the first steps, one step in "
                       f"{model.retention.every} and the newest. Mean, min and max are over every step, from the "
                       "per-block aggregates; p50 and p95 over the steps past the first (as the findings' medians), "
                       "from their quantile sketches (within 1%).")
        elif data.work_stats["sampled"].any():
            per = int(data.work_samples.groupby("device").size().max())
            st.caption(f"The distributions and percentiles use every k-th step ({per:,} per device), the percentiles "
                       "past the first (as the findings' medians); mean, min and max are over every step.")
        else:
            st.caption("Mean, min and max are over every step; p50 and p95 over the steps past the first, whose "
                       "one-time costs they leave out as the findings' medians do.")
        stats = data.work_stats.drop(columns=["sampled"])
        stats.columns = [c.replace("work_", f"{model.work.column}_", 1) for c in stats.columns]
        common.table(stats, f"{model.work.column}_per_{model.unit}")
    if data.idle:
        st.caption(f"{markdown_text(', '.join(data.idle))} got no chunk in any step: idle, drawn at zero.")
    if model.nothing_to_balance and not data.work_stats.empty:
        st.caption(markdown_text(model.nothing_to_balance))

    st.subheader(f"Memory per {model.unit}")
    if data.memory.empty:
        common.missing(data.missing["memory"])
    else:
        if data.memory_chart:
            common.chart(charts.memory_per_device(data.memory, data.idle, unit_word=model.unit, gathered=(
                "gathered parameters" if model.kind == "fsdp" else "gathered outputs")))
        else:  # one device's allocator peaks: words, not a chart of one marker
            st.markdown(markdown_text(data.memory_text))
        for key in ("allocator", "memory_accounting"):
            if key in data.missing:
                common.missing(data.missing[key])
        out = data.memory.loc[data.memory["output_device"].astype(bool), "device"].tolist() if model.gathers else []
        if out:
            st.caption(f"{markdown_text(out[0])} is the output device: the gathered outputs (and the loss) live there.")
        common.table(data.memory_table, f"memory_per_{model.unit}")
    if len(data.chunks):
        st.subheader("Chunk sizes")
        common.chart(charts.chunk_sizes(data.chunks, data.idle))
        common.table(data.chunks, "chunk_sizes")

    if data.gpus:  # the GPU sections belong to runs with GPUs; a CPU run's page says once that it has none
        st.subheader("GPUs over time")
        if data.gpu.empty:
            common.missing(data.missing.get("gpu_samples") or "No GPU samples were recorded for this run.")
        else:
            common.chart(charts.gpu_samples(data.gpu))
            common.table(data.gpu, "gpu_samples_bucketed")

    if data.gpus and model.imported:
        st.subheader("GPU time per device (from the trace)")
        if data.gpu_time.empty:
            common.missing(data.missing.get("gpu_time") or "The trace has no GPU activity.")
        else:
            common.chart(charts.gpu_time(data.gpu_time))
            common.table(data.gpu_time, "gpu_time_per_device")
    if not data.gpus and "gpu_samples" in data.missing:  # the GPU sections' absence, said once
        common.missing(data.missing["gpu_samples"])


common.live(body)
