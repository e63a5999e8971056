"""FSDP in its own words: each rank's all-gathers and reduce-scatters per step, issued against exposed.

One figure, computed once (dpprof.findings.fsdp.fsdp_collectives, which the findings read too); this module reads it
for ``dpprof show``, the Overview and the CSVs.
"""
from __future__ import annotations

import pandas as pd

from dpprof.findings import tables_of
from dpprof.findings.fsdp import fsdp_collectives
from dpprof.store.reader import StoredRun

__all__ = ["FSDP_COLLECTIVE_COLUMNS", "fsdp_collective_table"]

# The table's columns, units in their names (display_table turns them into headers)
FSDP_COLLECTIVE_COLUMNS = ["device", "collective", "per_step", "sent_bytes_per_step", "issued_ms", "exposed_ms",
                           "hidden_pct", "in_forward_per_step", "in_backward_per_step", "rank"]


def fsdp_collective_table(run: StoredRun) -> pd.DataFrame:
    """Per rank and collective, over the steps after the first: how many a step, their bytes a step, the time from
    launch to completion (issued), the part the rank waited for (exposed), the share hidden behind compute, and how
    many ran in forward and in backward. Empty for a run without FSDP collectives."""
    if not run.model.fsdp_phases or "comms" not in run.model.has:
        return pd.DataFrame(columns=FSDP_COLLECTIVE_COLUMNS)
    table = fsdp_collectives(tables_of(run))
    return table.rename(columns={"bytes_per_step": "sent_bytes_per_step", "forward_per_step": "in_forward_per_step",
                                 "backward_per_step": "in_backward_per_step"})[FSDP_COLLECTIVE_COLUMNS]
