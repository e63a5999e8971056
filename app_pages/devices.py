"""Devices: this machine's devices and the pre-flight check, with a batch size to try."""
from __future__ import annotations

from dataclasses import asdict

import pandas as pd
import streamlit as st
import torch

from app_pages import common
from dpprof import charts
from dpprof.device_ids import MAX_CPU_WORKERS, resolve_devices
from dpprof.devices import check_balance, chunk_sizes, cpu_info, inventory
from dpprof.nvml import Nvml, NvmlUnavailable

st.title("Devices")
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
st.subheader("This machine")
if gpus:
    st.dataframe(pd.DataFrame([asdict(d) for d in inventory(resolve_devices(list(range(gpus))))]), hide_index=True)
    try:
        with Nvml():
            st.caption("NVML is available: runs record utilisation, memory, power and temperature per GPU.")
    except NvmlUnavailable as err:
        common.missing(f"NVML is not available, so runs record no GPU samples: {err}")
else:
    common.missing(f"No CUDA GPU is visible here (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}). "
                   "dpprof runs on CPU workers instead: threads standing in for GPUs, with DataParallel's semantics.")
info = cpu_info()
st.dataframe(pd.DataFrame([{"cpu": info["cpu_model"] or "-", "cores": info["cores"], "threads": info["threads"]}]),
             hide_index=True)

st.subheader("Pre-flight check")
st.caption("Will these devices, at this batch size, train in balance? The same check as `dpprof check`.")
c1, c2 = st.columns(2)
if gpus:
    ids = c1.multiselect("GPUs", list(range(gpus)), default=list(range(gpus)), format_func=lambda i: f"cuda:{i}")
    labels = [f"cuda:{i}" for i in ids]
else:
    workers = int(c1.number_input("CPU workers", min_value=1, max_value=MAX_CPU_WORKERS, value=2, key="dev_workers"))
    ids = labels = [f"cpu:{i}" for i in range(workers)]
batch = int(c2.number_input("Batch size to try", min_value=1, max_value=1_000_000, value=30, key="dev_batch"))
if not ids:
    common.missing("Choose at least one device.")
else:
    found = check_balance(ids, batch)
    if not found:
        st.success(f"No findings: {len(ids)} device(s) at batch size {batch} look balanced.")
    for f in found:
        common.finding_box(f)
    common.chart(charts.check_chunks(chunk_sizes(batch, len(ids)), labels))
