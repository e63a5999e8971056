"""Overview of a run: each device at first glance, then step time, the phase breakdown per step, the DataParallel
tax and the findings."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from app_pages import common

_BOX = {"critical": st.error, "warning": st.warning, "info": st.info}


def findings(found: pd.DataFrame, scope: str) -> None:
    st.subheader("Findings")
    if found.empty:
        if scope.startswith("no findings") or scope.startswith("no steps"):
            common.missing(scope[0].upper() + scope[1:] + ".")
        else:
            st.caption(f"Worst first; {scope}.")
            st.success("No findings: nothing stands out in this run.")
        return
    st.caption(f"Worst first; {scope}.")
    for f in found.itertuples():
        where = f" · {f.device}" if isinstance(f.device, str) else ""
        _BOX.get(f.severity, st.info)(f"**{f.severity.upper()}{where}: {f.title}**\n\n"
                                      f"Evidence: {f.evidence}\n\nAdvice: {f.advice}")


def per_device(data) -> None:
    """The first screen: which device is the problem, in numbers and one chart."""
    g = data.glance
    c = st.columns(4)
    if g.time_ratio is not None:
        c[0].metric("Slowest device", g.slowest, help=f"the longest mean {g.work_phase} per step")
        c[1].metric(f"{g.work_phase.capitalize()} imbalance", f"{g.time_ratio:.2f}x",
                    f"{g.time_ratio - 1:+.0%} vs {g.fastest}", delta_color="off",
                    help="the slowest device's mean over the fastest's")
    if g.memory_ratio is not None:
        c[2].metric("Most memory", g.heaviest, help=g.memory_source)
        c[3].metric("Memory imbalance", f"{g.memory_ratio:.2f}x", f"{g.memory_ratio - 1:+.0%} vs {g.lightest}",
                    delta_color="off", help="the most a device holds over the least")
    if g.idle and g.time_ratio is None:
        c[0].metric("Idle devices", len(g.idle), help="devices of the run that never got a chunk")
    if len(g.devices):
        common.chart(charts.device_glance(g.devices, g.work_phase, g.memory_source, *g.marked()))
    for sentence in g.sentences:
        st.markdown(f"- {sentence}")
    if len(g.devices) < 2:
        st.caption("One device: nothing to balance.")


def body(row: pd.Series) -> None:
    common.run_header(row)
    data = common.view("overview", row)
    stats = data.stats
    if not stats["steps"]:
        common.missing("No steps recorded yet: the run has not finished its first step.")
        findings(data.findings, data.findings_scope)
        return
    per_device(data)
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
               "what runs outside DataParallel: " + ("the optimizer step, loading the batch (each device computes "
                                                     "its own loss inside apply)." if data.balanced else
                                                     "the loss, the optimizer step, loading the batch."))
    left, right = st.columns([3, 2])
    with left:
        common.chart(charts.phase_shares(data.totals))
    with right:
        st.subheader("The DataParallel tax")
        if data.tax_pct is not None:
            work = "Scatter, replicate and gather take" if data.gathers else "Scatter and replicate take"
            gather = "" if data.gathers else (" Nothing is gathered: each device keeps its outputs and computes its "
                                              "share of the loss.")
            st.markdown(f"{work} **{data.tax_pct:.1f}%** of the step (**{data.tax_ms:.2f} ms** per step).{gather} "
                        "DistributedDataParallel does none of this work: each process keeps its model replica and "
                        "its own inputs.")
        common.table(data.totals, "phase_totals")
    findings(data.findings, data.findings_scope)
    if len(data.breakdown) and int(data.breakdown["steps"].max()) > 1:
        st.caption(f"Charts show the mean of every {int(data.breakdown['steps'].max())} steps "
                   f"({len(data.breakdown):,} points for {stats['steps']:,} steps).")


common.live(body)
