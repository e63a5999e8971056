"""Overview of a run: step time, the phase breakdown per step, the DataParallel tax and the findings."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from app_pages import common

_BOX = {"critical": st.error, "warning": st.warning, "info": st.info}


def findings(found: pd.DataFrame, scope: str) -> None:
    st.subheader("Findings")
    st.caption(f"Worst first; {scope}.")
    if found.empty:
        st.success("No findings: nothing stands out in this run.")
        return
    for f in found.itertuples():
        where = f" · {f.device}" if isinstance(f.device, str) else ""
        _BOX.get(f.severity, st.info)(f"**{f.severity.upper()}{where}: {f.title}**\n\n"
                                      f"Evidence: {f.evidence}\n\nAdvice: {f.advice}")


def body(row: pd.Series) -> None:
    common.run_header(row)
    data = common.view("overview", row)
    stats = data.stats
    if not stats["steps"]:
        common.missing("No steps recorded yet: the run has not finished its first step.")
        return
    c = st.columns(5)
    c[0].metric("Steps", f"{stats['steps']:,}")
    c[1].metric("Median step", f"{stats['median_step_ms']:.2f} ms")
    c[2].metric("Mean step", f"{stats['mean_step_ms']:.2f} ms")
    if stats["batch_size"]:
        c[3].metric("Samples/s", f"{stats['batch_size'] / stats['median_step_ms'] * 1e3:,.0f}",
                    help=f"batch {stats['batch_size']} over the median step")
    if data.tax_pct is not None:
        c[4].metric("DataParallel tax", f"{data.tax_pct:.1f}%", help="scatter + replicate + gather: work only "
                    "DataParallel does (DistributedDataParallel has no replicate and no gather)")
    common.chart(charts.step_times(data.steps))
    common.chart(charts.phase_breakdown(data.breakdown))
    st.caption("apply (all devices) is parallel_apply: every device's apply, side by side. The rest of the step is "
               "what runs outside DataParallel: the loss, the optimizer step, loading the batch.")
    left, right = st.columns([3, 2])
    with left:
        common.chart(charts.phase_shares(data.totals))
    with right:
        st.subheader("The DataParallel tax")
        if data.tax_pct is not None:
            st.markdown(f"Scatter, replicate and gather take **{data.tax_pct:.1f}%** of the step "
                        f"(**{data.tax_ms:.2f} ms** per step). DistributedDataParallel does none of this work: "
                        "each process keeps its model replica and its own inputs.")
        common.table(data.totals.round(4), "phase_totals")
    findings(data.findings, data.findings_scope)
    if len(data.breakdown) and int(data.breakdown["steps"].max()) > 1:
        st.caption(f"Charts show the mean of every {int(data.breakdown['steps'].max())} steps "
                   f"({len(data.breakdown):,} points for {stats['steps']:,} steps).")


common.live(body)
