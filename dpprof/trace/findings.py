"""Findings only a trace can give (GPU idle time, communication on the GPU and its overlap, allocator
skew, DataParallel on several GPUs): pure functions, an imported run's DataFrames in, finding dicts out.

The rules recorded runs share (the straggler rank, the all-reduce share, the DataParallel tax, ...)
come from dpprof.findings and run on an imported run's tables unchanged.
"""
from __future__ import annotations

import pandas as pd

from dpprof.findings import COMM_SHARE_WARN, MEMORY_SKEW_RATIO, _f

__all__ = ["trace_findings", "GPU_IDLE_WARN"]

# A GPU idle for more than a quarter of the step is waiting on the host (data loading, Python,
# synchronisation) or on another GPU: HTA's idle-time breakdown flags the same.
GPU_IDLE_WARN = 0.25


def gpu_idle(gpu_time: pd.DataFrame) -> list[dict]:
    if gpu_time.empty:
        return []
    per = gpu_time.groupby("device")[["idle_ms", "window_ms"]].sum()
    per = per[per["window_ms"] > 0]
    out = []
    for device, row in per.iterrows():
        share = row["idle_ms"] / row["window_ms"]
        if share > GPU_IDLE_WARN:
            steps = int((gpu_time["device"] == device).sum())
            out.append(_f("gpu_idle", "warning" if share < 0.5 else "critical", device,
                          f"{device}'s GPU is idle {share:.0%} of the step",
                          f"no kernel, copy or memset ran for {row['idle_ms'] / steps:.2f} ms of a "
                          f"{row['window_ms'] / steps:.2f} ms step on average ({steps} steps)",
                          "The GPU waits on the host: look at data loading (more DataLoader workers, pinned memory), "
                          "host-side Python between kernels, and synchronising calls (.item(), .cpu()).", share))
    return out


def gpu_communication(gpu_time: pd.DataFrame) -> list[dict]:
    if gpu_time.empty or not (gpu_time["communication_ms"] > 0).any():
        return []
    per = gpu_time.groupby("device")[["communication_ms", "overlap_ms", "window_ms"]].sum()
    comm, overlap, window = per["communication_ms"].sum(), per["overlap_ms"].sum(), per["window_ms"].sum()
    share = comm / window if window else 0.0
    overlapped = overlap / comm if comm else 0.0
    if share < COMM_SHARE_WARN:
        return []
    return [_f("gpu_communication", "warning", None,
               f"communication kernels run {share:.0%} of the step, {overlapped:.0%} of it overlapped with compute",
               "per device: " + "; ".join(f"{d} {r['communication_ms'] / r['window_ms']:.0%} communication, "
                                          f"{r['overlap_ms'] / r['communication_ms'] if r['communication_ms'] else 0:.0%} "
                                          "overlapped" for d, r in per.iterrows()),
               "Raise the per-rank batch (communication is per step, compute per sample), let DDP overlap more "
               "(smaller bucket_cap_mb so all-reduces start earlier in backward), or compress gradients with a "
               "communication hook.", share)]


def allocator_skew(allocator: pd.DataFrame) -> list[dict]:
    if allocator.empty or allocator["device"].nunique() < 2:
        return []
    peak = allocator.groupby("device")["peak_allocated_bytes"].max()
    first = peak.index[0] if "cuda:0" not in peak.index else "cuda:0"
    others = peak.drop(first)
    ratio = peak[first] / others.mean() if others.mean() else 1.0
    if ratio < MEMORY_SKEW_RATIO:
        return []
    return [_f("memory_skew", "warning" if ratio < 2 else "critical", first,
               f"{first} peaks at {ratio:.2f}x the memory of the other GPUs",
               f"allocator peak from the trace's [memory] events: {first} {peak[first] / 2**20:.1f} MiB, the others "
               f"{others.mean() / 2**20:.1f} MiB on average",
               "DataParallel gathers every output and computes the loss on the first device: compute the loss on "
               "every device (dpprof.DataParallelModel with dpprof.DataParallelCriterion) or move to "
               "DistributedDataParallel.", ratio)]


def dataparallel_gpus(devices: list[str], dataparallel: str | None) -> list[dict]:
    gpus = [d for d in devices if d.startswith("cuda")]
    if dataparallel is None or len(gpus) < 2:
        return []
    return [_f("use_ddp", "info", None, f"DataParallel on {len(gpus)} GPUs",
               f"the trace shows DataParallel.forward driving {', '.join(gpus)} from one process",
               "One process drives every GPU under the GIL, replicates the model every step and gathers outputs "
               "on one GPU: DistributedDataParallel (one process per GPU) is PyTorch's recommendation and is "
               "usually faster; dpprof.DistributedDataParallel records it the same way.", float(len(gpus)))]


def trace_findings(gpu_time: pd.DataFrame, allocator: pd.DataFrame, devices: list[str],
                   dataparallel: str | None, found_kinds: set[str]) -> list[dict]:
    """The trace-only findings, leaving out what the shared rules (``found_kinds``) already said."""
    rows = gpu_idle(gpu_time) + dataparallel_gpus(devices, dataparallel)
    if "communication_share" not in found_kinds:
        rows += gpu_communication(gpu_time)
    if "memory_skew" not in found_kinds:
        rows += allocator_skew(allocator)
    return rows
