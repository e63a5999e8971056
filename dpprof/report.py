"""A stored run's summaries and findings, composed from the store and the analysis functions."""
from __future__ import annotations

import logging

import pandas as pd

from dpprof.findings import FINDING_COLUMNS, run_findings
from dpprof.store import queries
from dpprof.store.reader import StoredRun, load_run
from dpprof.store.writer import replace_findings

__all__ = ["findings_of", "summary_of", "store_findings", "SUMMARY_COLUMNS"]

log = logging.getLogger("dpprof")


def findings_of(run: StoredRun) -> pd.DataFrame:
    """The run's findings, computed from its tables (so a running or killed run has them too); an imported
    trace's are those stored at import, which include the trace-only rules (dpprof.trace.findings)."""
    if run.meta.get("source") == "trace":
        return run.findings.drop(columns=["rank"], errors="ignore").reset_index(drop=True)
    return run_findings(run.steps, run.phases, run.memory, run.allocator, run.gpu_samples,
                        list(run.meta["devices"]), comms=run.comms)


# The per-device summary's headline columns (dpprof show prints these; exports carry every column).
SUMMARY_COLUMNS = ["apply_mean_ms", "apply_p50_ms", "apply_p95_ms", "apply_share_of_step_pct", "chunk_size_mean",
                   "peak_held_bytes", "peak_allocated_bytes"]


def summary_of(run: StoredRun) -> pd.DataFrame:
    """The per-device summary of a stored run, indexed by device, aggregated in SQL (large runs stay fast).

    Columns: steps, apply_mean_ms, apply_min_ms, apply_max_ms, apply_p50_ms, apply_p95_ms,
    apply_share_of_step_pct, sampled (percentiles from every k-th step of a long run), output_device,
    peak_step, peak_held_bytes and what was held then by kind, chunk_size_mean/min/max,
    peak_allocated_bytes and peak_reserved_bytes (CUDA allocator; NaN on CPU workers). "apply" is a
    DDP rank's forward plus backward compute.
    """
    stats = queries.apply_stats(run)
    memory = queries.memory_peaks(run)
    out = stats.merge(memory, on="device", how="outer") if len(stats) else memory
    return out.set_index("device")


def store_findings(run: object) -> None:
    """Close hook: compute a finished run's findings and store them in its file."""
    path = getattr(run, "path", None)
    if path is None or getattr(run, "rank", None) is not None:
        return  # a rank cannot read the other ranks' files while they close; their findings are computed on read
    try:
        findings = findings_of(load_run(path))
        replace_findings(path, [tuple(row) for row in findings[FINDING_COLUMNS].itertuples(index=False)])
    except Exception as err:  # the run itself is safe on disk; only its findings table is missing
        log.warning("dpprof: could not store findings for %s: %s", path, err)
