"""Pure functions over run DataFrames: summaries per device and per phase. No plotting, no I/O."""
from __future__ import annotations

import pandas as pd

from dpprof.records import DDP_PHASES, PHASES


__all__ = ["phase_table", "device_summary"]


def phase_table(phases: pd.DataFrame) -> pd.DataFrame:
    """Mean milliseconds per step of each phase on each device (devices as rows, phases as columns).

    A phase run several times in one step (several forward calls) is summed within the step first.
    """
    if phases.empty:
        return pd.DataFrame(columns=[f"{p}_ms" for p in PHASES])
    per_step = phases.groupby(["device", "phase", "step"], sort=False)["duration_ms"].sum()
    table = per_step.groupby(["device", "phase"]).mean().unstack("phase")
    order = DDP_PHASES if "forward" in table.columns else PHASES
    table = table.reindex(columns=[p for p in order if p in table.columns])
    table.columns = [f"{c}_ms" for c in table.columns]
    table.index.name = "device"
    return table.sort_index()


def _held_bytes(memory: pd.DataFrame) -> pd.Series:
    """Bytes dpprof accounts to each device per step: chunk, outputs, activations, gathered, weights."""
    held = memory[["input_bytes", "output_bytes", "activation_bytes", "gathered_bytes", "param_bytes",
                   "buffer_bytes"]].sum(axis=1)
    return held.groupby([memory["device"], memory["step"]]).sum()


def device_summary(steps: pd.DataFrame, phases: pd.DataFrame, memory: pd.DataFrame,
                   allocator: pd.DataFrame) -> pd.DataFrame:
    """One row per device: apply time (mean, p50, p95), share of the step, chunk size and peak memory.

    On DistributedDataParallel runs (ranks as devices) "apply" is a rank's forward plus backward compute.

    Returns:
        columns apply_mean_ms, apply_p50_ms, apply_p95_ms, apply_share_of_step_pct, chunk_size_mean,
        peak_held_bytes (what dpprof accounts on every backend), peak_allocated_bytes (CUDA allocator;
        NaN on CPU workers), indexed by device.
    """
    # a device's own compute: its replica's apply, or on a DDP rank its forward and backward compute
    own = ["apply"] if (phases["phase"] == "apply").any() else ["forward", "backward_compute"]
    apply = phases[phases["phase"].isin(own)].groupby(["device", "step"])["duration_ms"].sum()
    by_device = apply.groupby("device")
    out = pd.DataFrame({
        "apply_mean_ms": by_device.mean(),
        "apply_p50_ms": by_device.quantile(0.5),
        "apply_p95_ms": by_device.quantile(0.95),
    })
    step_mean = steps["duration_ms"].mean() if not steps.empty else float("nan")
    out["apply_share_of_step_pct"] = 100 * out["apply_mean_ms"] / step_mean
    if not memory.empty:
        out["chunk_size_mean"] = memory.groupby("device")["chunk_size"].mean()
        out["peak_held_bytes"] = _held_bytes(memory).groupby("device").max()
    else:
        out["chunk_size_mean"] = float("nan")
        out["peak_held_bytes"] = float("nan")
    out["peak_allocated_bytes"] = (allocator.groupby("device")["peak_allocated_bytes"].max()
                                   if not allocator.empty else float("nan"))
    out.index.name = "device"
    return out.sort_index()
