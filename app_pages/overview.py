"""Overview of a run: each device at first glance, then step time, the phase breakdown per step, the section of
its kind (the DataParallel tax, the gradient all-reduce, GPU time) and the findings."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from dpprof.findings import Findings
from dpprof.plaintext import capitalized, markdown_text
from dpprof.views import overview
from dpprof.units import plural
from dpprof.views.text import batch_words, sentence, steps_per_rank
from app_pages import common


def findings(found: Findings) -> None:
    st.subheader("Findings")
    if found.withheld:
        common.missing(sentence(found.scope))
        return
    st.caption(f"Worst first; {markdown_text(found.scope)}.")
    if found.table.empty:
        st.success("No findings: nothing stands out in this run.")
    for f in found.table.itertuples():
        common.finding_box(f)


def per_device(data: overview.Overview) -> None:
    """The first screen: which device is the problem, in numbers and one chart."""
    g, unit = data.glance, data.model.unit
    c = st.columns(4)
    if g.time_uneven and g.from_collectives:  # the rank the others wait for inside the collectives
        c[0].metric(f"Straggler {markdown_text(unit)}", g.slowest, help="the one the others wait for inside the "
                    "collectives: it waited least, collective after collective")
        c[1].metric("Others' wait", f"{g.wait_ms:.2f} ms a step", f"{g.wait_share:.0%} of the median step past the first",
                    delta_color="off", help="what the others wait for it inside the collectives per step (the straggler "
                    "finding's figure); its own work, collectives inside, may be the shortest")
    elif g.time_uneven:
        c[0].metric(f"Slowest {markdown_text(unit)}", g.slowest, help=f"the longest median {g.work_phase} per step")
        c[1].metric(f"{capitalized(data.model.work.column)} imbalance", f"{g.time_ratio:.2f}x",
                    f"{g.wait_ms:.2f} ms a step", delta_color="off",
                    help=f"the slowest {unit}'s median {g.work_phase} over the others' (the first step left out); "
                    "what the others wait for it per step")
    if g.memory_uneven:
        c[2].metric("Most memory", g.heaviest, help=markdown_text(g.memory_source))
        c[3].metric("Memory imbalance", f"{g.memory_ratio:.2f}x", f"{g.memory_ratio - 1:+.0%} vs the others",
                    delta_color="off", help="what it holds over the others' average (the memory-skew finding)")
    if g.idle and not g.time_uneven:
        c[0].metric("Idle devices", len(g.idle), help="devices of the run that never got a chunk")
    if len(g.devices) and g.devices["work_ms"].notna().any():
        common.chart(charts.device_glance(g.devices, g.work_phase, g.memory_source, *g.marked()))
    for line in g.sentences:  # they name devices and the findings' words: plain text
        st.markdown(f"- {markdown_text(line)}")
    if data.model.nothing_to_balance:  # said once, in this run's terms (one GPU, a rank of a bigger job)
        st.caption(markdown_text(data.model.nothing_to_balance))


def _breakdown_caption(data: overview.Overview) -> str:
    model = data.model
    batch = ("the script's own code (no DataLoader ran: building the batch, logging)" if data.no_data_loader
             else "loading the batch")
    if model.dataparallel:
        rest = (f"the optimizer step, {batch} (each device computes its own loss inside apply)."
                if not model.gathers else f"the loss, the optimizer step, {batch}."
                if "loss" not in model.phases else f"the optimizer step, {batch}.")
        return ("apply (all devices) is parallel_apply: every device's apply, side by side. The rest of the step is "
                "what runs outside DataParallel: " + rest)
    ranks = "Each bar is the ranks' mean. " if model.unit == "rank" and len(model.devices) > 1 else ""
    said = []  # only the phases this run has, each in its own kind's terms
    if "data" in model.phases:
        said.append("data is the time before the step's forward (" + (
            "no DataLoader ran: the script's own work since the previous step, such as building the batch"
            if data.no_data_loader else "loading the batch") + ")")
    if "comm_wait" in model.phases:
        said.append("backward compute ends when the last gradient bucket is launched, the all-reduce wait after it"
                    if model.kind == "ddp" else
                    "backward compute ends when the step's last collective is launched, the wait for the "
                    "collectives to finish after it")
    elif "backward_compute" in model.phases:  # no collective: nothing to wait for after backward
        said.append("backward compute is the span of the step's autograd ops")
    said.append("the rest is what no phase covers")
    return ranks + sentence("; ".join(said))


def kind_section(data: overview.Overview) -> None:
    """The part of the Overview only some kinds of run have, in their own terms."""
    model = data.model
    if data.tax_pct is not None:
        st.subheader("The DataParallel tax")
        if model.gathers:
            st.markdown(f"Scatter, replicate and gather take **{data.tax_pct:.1f}%** of the mean step past the first "
                        f"(**{data.tax_ms:.2f} ms** per step; the first carries one-time costs, and the findings weigh "
                        "the same figure). DistributedDataParallel does none of this work: each process keeps its "
                        "model replica and its own inputs.")
        else:
            st.markdown(f"Scatter and replicate take **{data.tax_pct:.1f}%** of the mean step past the first "
                        f"(**{data.tax_ms:.2f} ms** per step; the findings weigh the same figure). Nothing is gathered: each device keeps its outputs and computes its share of the loss "
                        "(the balanced model and criterion).")
    elif len(data.fsdp):
        st.subheader("FSDP collectives")
        st.markdown("Each rank's all-gathers and reduce-scatters per step past the first (the first carries "
                    "one-time costs; the findings weigh the same figures): how many, the bytes they moved, the time "
                    "from launch to completion (issued), the part the rank waited for (exposed), the share hidden "
                    "behind compute, and how many ran in forward and in backward (resharding after forward gathers "
                    "again in backward). On gloo every FSDP collective blocks the host: issued is all exposed.")
        common.table(data.fsdp, "fsdp_collectives_per_rank")
    elif len(data.comms) and model.named_collectives:
        st.subheader("Collectives (from the trace)")
        st.markdown("Each rank's collective kernels per step past the first, named by what they are: how long they were busy "
                    "(several in flight count once, clipped to the step), the bytes they sent, and how much of that "
                    "ran while backward was still computing.")
        common.table(data.comms, "collectives_per_rank")
    elif len(data.comms):
        st.subheader("Gradient all-reduce")
        st.markdown("Each rank's gradient buckets per step past the first (the first is DDP's start-up): how long the all-reduce was busy, and how much of that "
                    "ran while backward was still computing.")
        common.table(data.comms, "allreduce_per_rank")
    if data.waits is not None:
        st.subheader("Who waits for whom: the wait inside the collectives")
        st.markdown("Each rank's time inside its collectives beyond the shortest rank's (which is the time to move the "
                    "data once all have arrived), per step. The row that stays pale is the rank the others wait for.")
        for note in data.waits.notes:
            st.caption(markdown_text(f"{note[:1].upper()}{note[1:]}."))
        if len(data.waits.heatmap):
            common.chart(charts.collective_waits(data.waits.heatmap))
        else:
            st.caption("No collective could be matched across the ranks: the straggler verdict is from each rank's "
                       "work.")
    if data.tax_pct is None and not len(data.comms) and len(data.gpu):
        st.subheader("GPU time (from the trace)")
        st.markdown("Each GPU's step by what it ran: computation, communication, their overlap, copies and idle time.")


def body(row: pd.Series) -> None:
    common.run_header(row)
    common.capture_button(row)  # a running run: profile its next steps with torch.profiler
    data = common.view(overview.overview, row)
    stats = data.stats
    if not stats["steps"]:
        if row["status"] == "running":
            common.missing("No steps recorded yet: the run has not finished its first step.")
        return
    per_device(data)
    c = st.columns(5)
    ranks = int(row["ranks"]) if pd.notna(row.get("ranks")) else 1
    spread = steps_per_rank(stats, ranks)
    c[0].metric("Steps", f"{stats['steps']:,}", help=f"{plural(stats['steps'], 'step')}{spread}" if spread else None)
    if ranks > 1 and stats["steps_fewest"] != stats["steps"]:  # ranks holding fewer steps: said beside the figure
        st.caption(markdown_text(f"{plural(stats['steps'], 'step')}{spread}."))
    c[1].metric("Median step", f"{stats['median_step_ms']:.2f} ms")
    c[2].metric("Mean step", f"{stats['mean_step_ms']:.2f} ms")
    if data.throughput is not None:
        c[3].metric("Samples/s", f"{data.throughput.samples_per_s:,.0f}",
                    help=f"{data.throughput.words()} (batch {batch_words(stats, ranks)})")
    if data.tax_pct is not None:
        c[4].metric("DataParallel tax", f"{data.tax_pct:.1f}%", help="scatter + replicate + gather, of the mean step past "
                    "the first: work only DataParallel does (DistributedDataParallel has no replicate and no gather)")
    common.chart(charts.step_times(data.steps, data.outliers))
    if data.totals.empty or data.breakdown.empty:
        common.missing("No phases recorded: the steps' time is not split into phases.")
    else:
        common.chart(charts.phase_breakdown(data.breakdown))
        st.caption(_breakdown_caption(data))
        left, right = st.columns([3, 2])
        with left:
            common.chart(charts.phase_shares(data.totals))
        with right:
            common.table(data.totals, "phase_totals")
        kind_section(data)
    if len(data.gpu):
        common.chart(charts.gpu_time(data.gpu))
    findings(data.findings)
    if len(data.breakdown) and int(data.breakdown["steps"].max()) > 1:
        st.caption(f"Charts show every {int(data.breakdown['steps'].max()):,} steps as one point "
                   f"({len(data.breakdown):,} points for {stats['steps']:,} steps): the step time's median and "
                   "min-max band, each phase's mean.")
    detail = data.model.detail_text()
    if detail:
        st.caption(f"{markdown_text(detail)} These pages read the aggregates; the Timeline shows the kept detail.")


common.live(body)
