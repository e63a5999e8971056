"""The Kernels page of one run: its kernels (by name, or by kernel and the operator that launched it with grid,
block, registers and shared memory) and each GPU's utilization, SM efficiency and achieved occupancy per step,
with their definitions in the TensorBoard profiler plugin's words."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.store import detail_rows
from dpprof.store.reader import StoredRun
from dpprof.views.opdiff import Pick

__all__ = ["GPU_METRIC_DEFINITIONS", "KernelsPage", "kernels_page", "picks", "missing_text", "kernel_table",
           "gpu_per_step", "gpu_summary"]

# The TensorBoard plugin's definitions (kineto tb_plugin/docs/gpu_utilization.md), as dpprof.trace.detail computes
# them: shown on the page beside the figures.
GPU_METRIC_DEFINITIONS = {
    "GPU utilization": "GPU busy time / all steps' time, the higher the better. GPU busy time is the time during "
                       "which there is at least one GPU kernel running on it. It shows neither how many SMs are "
                       "in use nor how well each SM is used.",
    "Est. SM efficiency": "Estimated Stream Multiprocessor efficiency, the higher the better: SM_Eff_K = "
                          "min(blocks of this kernel / SM number of this GPU, 100%); the GPU's figure is the sum "
                          "of all kernels' SM_Eff_K weighted by their execution duration, divided by the step "
                          "time. It shows how many SMs are busy, not how well each one is used.",
    "Est. achieved occupancy": "Occupancy is the ratio of active warps on an SM to the maximum number of active "
                               "warps supported by the SM. OCC_K = min(threads of the kernel / SM number / max "
                               "threads per SM, theoretical occupancy of the kernel); the GPU's figure is the "
                               "mean of OCC_K weighted by each kernel's execution duration, the higher the "
                               "better.",
}


def missing_text(run: StoredRun) -> str | None:
    """Why the run has no kernels and what to do (one sentence), or None where it has them."""
    why = detail_rows.detail_missing(run)
    if why is not None:
        return why[0].upper() + why[1:] + "."
    if detail_rows.kernels(run, top=1).empty:
        return ("No GPU kernels in this run: it ran on the CPU (or its trace was recorded without "
                "ProfilerActivity.CUDA). Its operators' host times are on the Operators page.")
    return None


def kernel_table(run: StoredRun, pick: Pick, by: str = "name", search: str | None = None) -> pd.DataFrame:
    """The pick's kernels (detail_rows.kernels: ``by`` "name" or "operator"), by total time."""
    df = detail_rows.kernels(run, by=by, rank=pick.rank, device=pick.device, search=search or None)
    drop = [c for c, v in (("rank", pick.rank), ("device", pick.device)) if v is not None]
    return df.drop(columns=drop)


def gpu_per_step(run: StoredRun, pick: Pick) -> pd.DataFrame:
    """Utilization, SM efficiency and achieved occupancy per rank, device and step (detail_rows.gpu_metrics)."""
    return detail_rows.gpu_metrics(run, rank=pick.rank, device=pick.device)


def gpu_summary(run: StoredRun) -> pd.DataFrame:
    """Each GPU's figures over all steps (detail_rows.gpu_summary), one row per rank and device."""
    return detail_rows.gpu_summary(run)


def picks(run: StoredRun) -> list[Pick]:
    """Every (rank, device) that ran kernels (the rank None in a run of one rank)."""
    pairs = detail_rows.gpu_summary(run)[["rank", "device"]].drop_duplicates().sort_values(["rank", "device"])
    one = pairs["rank"].nunique() <= 1
    return [Pick(None if one else int(r), str(d)) for r, d in pairs.itertuples(index=False, name=None)]


@dataclass
class KernelsPage:
    """What the Kernels page shows for one pick, read in one go."""

    summary: pd.DataFrame  # gpu_summary: every GPU of the run
    per_step: pd.DataFrame  # gpu_per_step of the pick
    table: pd.DataFrame  # kernel_table of the pick


def kernels_page(run: StoredRun, pick: Pick, by: str = "name", search: str | None = None) -> KernelsPage:
    """The Kernels page's data for a pick."""
    return KernelsPage(summary=gpu_summary(run), per_step=gpu_per_step(run, pick),
                       table=kernel_table(run, pick, by, search))
