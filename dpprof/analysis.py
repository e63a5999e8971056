"""Pure functions over run DataFrames: the per-phase summary. No plotting, no I/O."""
from __future__ import annotations

import pandas as pd

from dpprof.records import DDP_PHASES, PHASES

__all__ = ["phase_table"]


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
