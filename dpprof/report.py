"""A stored run's per-device summary, in its kind's terms, and the close hook that stores its findings."""
from __future__ import annotations

import logging

import pandas as pd

from dpprof.records import MEMORY_BYTES
from dpprof.store import queries
from dpprof.store.reader import StoredRun, load_run
from dpprof.store.writer import replace_findings

__all__ = ["summary_of", "summary_columns", "store_findings"]

log = logging.getLogger("dpprof")


def summary_of(run: StoredRun) -> pd.DataFrame:
    """The per-device summary of a stored run, indexed by device in the run's order, aggregated in SQL: the
    columns of what the run measured, in its kind's terms, never a column of another kind's (an imported trace
    has no output device, a rank no chunk sizes) nor one of a measurement the run lacks (run.model.missing
    says why it lacks it).

    Columns, with ``<work>`` the run's work (run.model.work.column: "apply" for DataParallel, "compute" for a
    process's forward and backward compute): steps; where the run has its work, <work>_mean_ms,
    <work>_min_ms, <work>_max_ms, <work>_p50_ms, <work>_p95_ms, <work>_share_of_step_pct and sampled
    (percentiles over the steps past the first, as the findings' medians: queries.work_stats; from every k-th step,
    or a long run's quantile sketches); with dpprof's memory accounting,
    peak_step, peak_held_bytes and what was held then by kind (and output_device where outputs are gathered,
    chunk_size_mean/min/max for DataParallel); with the CUDA allocator, peak_allocated_bytes and
    peak_reserved_bytes; for an imported trace with GPUs, gpu_step_ms, gpu_busy_ms and gpu_idle_pct. Every device
    of the run has a row, with at least its steps; a column no device has a value in is left out.
    """
    model = run.model
    stats = queries.work_stats(run).set_index("device")
    stats.columns = [c.replace("work_", f"{model.work.column}_", 1) for c in stats.columns]
    memory = queries.memory_peaks(run).set_index("device")
    gpu = queries.gpu_time(run).set_index("device")[["step_ms", "busy_ms", "idle_pct"]].add_prefix("gpu_")
    idle = set(model.idle)  # devices DataParallel gave no chunk: a row each, of no work
    devices = ([d for d in model.devices if d in stats.index or d in memory.index or d in gpu.index or d in idle]
               or list(model.devices))
    if stats.empty:  # no work recorded: each device still has the run's steps
        stats = pd.DataFrame({"steps": model.steps}, index=pd.Index(devices, name="device"))
    drop = []
    if "memory" not in model.has:
        drop += ["output_device", "peak_step", "peak_held_bytes", *MEMORY_BYTES]
    if not model.gathers:
        drop += ["output_device"]
    if "memory" not in model.has or not model.dataparallel:
        drop += ["chunk_size_mean", "chunk_size_min", "chunk_size_max"]
    if "allocator" not in model.has:
        drop += ["peak_allocated_bytes", "peak_reserved_bytes"]
    memory = memory.drop(columns=[c for c in dict.fromkeys(drop) if c in memory.columns])
    out = pd.concat([stats.reindex(devices), memory.reindex(devices)], axis=1)
    for column in ("steps", "chunk_size_mean", "chunk_size_min", "chunk_size_max"):  # an idle device's: none
        if idle and column in out.columns:
            out.loc[out.index.isin(idle) & out[column].isna(), column] = 0
    if len(gpu):
        out = pd.concat([out, gpu.reindex(devices)], axis=1)
    out.index.name = "device"
    return out.dropna(axis=1, how="all")  # a figure no device has (a 2021 trace's reserved bytes) is no column


def summary_columns(run: StoredRun, summary: pd.DataFrame) -> list[str]:
    """The summary's headline columns for ``dpprof show``, those the run has (exports carry every column); none
    where the run has no figure per device (``dpprof show`` then says why, from run.model.missing)."""
    work = run.model.work.column
    wanted = [f"{work}_mean_ms", f"{work}_p50_ms", f"{work}_p95_ms", f"{work}_share_of_step_pct"]
    if "memory" in run.model.has:
        wanted += ["chunk_size_mean", "peak_held_bytes"]
    if "allocator" in run.model.has:
        wanted += ["peak_allocated_bytes"]
    wanted += ["gpu_busy_ms", "gpu_idle_pct"]
    return [c for c in wanted if c in summary.columns and summary[c].notna().any()]


def store_findings(run: object) -> None:
    """Close hook: compute a finished run's findings from every step and store them in its file."""
    from dpprof.findings import FINDING_COLUMNS, run_findings

    path = getattr(run, "path", None)
    if path is None or getattr(run, "rank", None) is not None:
        return  # a rank cannot read the other ranks' files while they close; their findings are computed on read
    try:
        findings = run_findings(load_run(path), fresh=True).table
        replace_findings(path, [tuple(row) for row in findings[FINDING_COLUMNS].itertuples(index=False)])
    except Exception as err:  # the run itself is safe on disk; only its findings table is missing
        log.warning("dpprof: could not store findings for %s: %s", path, err)
