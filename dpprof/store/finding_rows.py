"""The rows the findings' rules read from a run (dpprof.findings.tables_of), as named reads.

A long run (run.model.aggregated) is read through the steps whose detail stands for it without bias
(RunModel.sample_ranges: one step in ``every``), never the outliers and peaks
kept for their own sake: that rule is applied here, once. Each frame has a ``rank`` column, as
StoredRun.query gives it.
"""
from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from dpprof.store.reader import TABLES, StoredRun

__all__ = ["SAMPLED_TABLES", "empty", "from_step", "gpu_samples_from", "kept_steps_trained", "last_step", "sampled",
           "sampled_phases"]

# The tables whose rows a long run is read through its sample of steps: every step's time is kept, but the
# findings' medians and shares must not be pulled by outliers kept for their own sake (the phases and comms
# are detail rows; the steps read beside them are those same steps).
SAMPLED_TABLES = ("steps", "phases", "comms")


def _table(name: str) -> str:
    """``name`` if it is one of the run's record tables, else a KeyError naming it."""
    if name not in TABLES:
        raise KeyError(f"no table {name!r}; tables are {', '.join(TABLES)}")
    return name


def empty(run: StoredRun, table: str) -> pd.DataFrame:
    """``table`` with its columns (and ``rank``) and no rows."""
    return run.query(f"SELECT * FROM {_table(table)} WHERE 0")


def sampled(run: StoredRun, table: str) -> pd.DataFrame:
    """Every row of ``table``; of SAMPLED_TABLES, those of the steps whose detail stands for the run."""
    where = f" WHERE {run.model.sampled_steps_sql()}" if table in SAMPLED_TABLES else ""
    return run.query(f"SELECT * FROM {_table(table)}{where}")


def sampled_phases(run: StoredRun, phases: Sequence[str]) -> pd.DataFrame:
    """The rows of ``phases`` (names) in the steps whose detail stands for the run."""
    return run.query(f"SELECT * FROM phases WHERE phase IN ({', '.join('?' * len(phases))}) AND "
                     f"{run.model.sampled_steps_sql()}", tuple(phases))


def last_step(run: StoredRun) -> float:
    """The run's largest step number over its ranks (NaN for a run with no steps)."""
    return run.query("SELECT MAX(step) AS s FROM steps")["s"].max()


def from_step(run: StoredRun, table: str, step: int) -> pd.DataFrame:
    """The rows of ``table`` from ``step`` on; of the phases and comms, those of the steps whose detail stands for
    the run (every step's time is read: the last steps are few)."""
    where = f" AND {run.model.sampled_steps_sql()}" if table in ("phases", "comms") else ""
    return run.query(f"SELECT * FROM {_table(table)} WHERE step >= ?{where}", (step,))


def gpu_samples_from(run: StoredRun, t_ms: float) -> pd.DataFrame:
    """The NVML samples from ``t_ms`` (the run's clock) on."""
    return run.query("SELECT * FROM gpu_samples WHERE t_ms >= ?", (float(t_ms),))


def kept_steps_trained(run: StoredRun) -> pd.Series:
    """Of every step whose detail the run kept (a phase row on any rank; a thinned step keeps none), whether a
    backward ran in it on any rank: bool by step."""
    rows = run.query("SELECT step, MAX(phase = 'backward') AS trained FROM phases GROUP BY step")
    return rows.groupby("step")["trained"].max().astype(bool)
