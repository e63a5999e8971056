"""A stored run's summaries and findings, composed from the store and the analysis functions."""
from __future__ import annotations

import logging

import pandas as pd

from dpprof.analysis import device_summary
from dpprof.findings import FINDING_COLUMNS, run_findings
from dpprof.store.reader import StoredRun, load_run
from dpprof.store.writer import replace_findings

__all__ = ["findings_of", "summary_of", "store_findings"]

log = logging.getLogger("dpprof")


def findings_of(run: StoredRun) -> pd.DataFrame:
    """The run's findings, computed from its tables (so a running or killed run has them too)."""
    return run_findings(run.steps, run.phases, run.memory, run.allocator, run.gpu_samples,
                        list(run.meta["devices"]), comms=run.comms)


def summary_of(run: StoredRun) -> pd.DataFrame:
    """The per-device summary of a stored run."""
    return device_summary(run.steps, run.phases, run.memory, run.allocator)


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
