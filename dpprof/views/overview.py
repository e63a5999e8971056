"""The Overview page of one run: each device at a glance, step time, the phase breakdown, the DataParallel tax
(DataParallel runs), the gradient all-reduce (DDP ranks), GPU time (imported traces) and the findings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dpprof.findings import Findings, run_findings
from dpprof.findings.base import split_script_comms
from dpprof.findings.ddp import bucket_counts, collective_busy, later_collectives, overlapped_ms
from dpprof.findings.collectives import match_collectives, wait_heatmap
from dpprof.findings.dataparallel import MEMORY_SKEW_RATIO
from dpprof.findings.floors import MEMORY_FLOOR_BYTES
from dpprof.loaders import none_iterated
from dpprof.records import HOST_OUTPUT
from dpprof.store import queries
from dpprof.store.collective_rows import rank_collectives
from dpprof.store.model import RunModel
from dpprof.store.reader import StoredRun
from dpprof.units import mib, plural
from dpprof.views.fsdp import fsdp_collective_table

__all__ = ["MEMORY_SOURCES", "Glance", "Overview", "CollectiveWaitView", "memory_figure", "glance", "overview",
           "comm_stats", "collective_wait_view"]

# Devices are marked exactly where a finding names them: the slowest where the straggler finding does
# (dpprof.findings.straggler_verdict), the fullest where the memory-skew finding does, each with the finding's figures.


@dataclass
class Glance:
    """Each device's work and memory side by side: which device is the problem, at first glance.

    ``devices`` has one row per device of the run, idle ones included (zero, ``idle`` True): device, work_ms
    (median per step of the run's work, the first step left out: the definition the straggler finding uses),
    peak_bytes (the allocator's peak allocated where recorded, else what dpprof accounts to the device in its
    peak step; NaN where the run has neither), output_device, idle.
    """

    devices: pd.DataFrame
    work_phase: str  # the run's work in words: "apply", "forward + backward compute"
    memory_source: str | None  # "peak allocated (CUDA allocator)", "peak held in one step (dpprof's accounting)", None
    slowest: str | None  # the device the others wait for, when two or more devices worked
    fastest: str | None
    time_ratio: float | None  # the slowest device's median over the others' (dpprof.findings.imbalance)
    wait_ms: float | None  # how long the others wait for the slowest, per step: its median less theirs
    time_uneven: bool  # the straggler finding names it: the headline's device, with the finding's wait
    heaviest: str | None  # the device holding the most memory
    lightest: str | None
    memory_ratio: float | None  # the skewed device's peak over the others' average (the finding's); else fullest / emptiest
    memory_uneven: bool  # the memory-skew finding names ``heaviest``: the headline marks it
    idle: list[str]  # devices of the run that never got a chunk
    sentences: list[str]  # the above, in words
    # the verdict came from the collectives (the rank the others wait for inside them): its work may be the shortest,
    # so the headline names it with the others' wait, not a work ratio (which reads under 1x for an FSDP rank)
    from_collectives: bool = False
    wait_share: float | None = None  # wait_ms over the median step past the first (the straggler finding's value)

    def marked(self) -> tuple[str | None, str | None]:
        """The slowest and the heaviest device to mark, each None where the devices read as even."""
        return (self.slowest if self.time_uneven else None, self.heaviest if self.memory_uneven else None)


@dataclass
class Overview:
    """The Overview page of one run."""

    model: RunModel
    glance: Glance
    stats: dict[str, Any]
    throughput: queries.Throughput | None  # samples/s: the run's samples over the time it took
    steps: pd.DataFrame  # queries.step_times
    breakdown: pd.DataFrame  # queries.phase_breakdown
    totals: pd.DataFrame  # queries.phase_totals
    findings: Findings
    # scatter + replicate (+ gather), % of the mean step past the first (Findings.tax): DataParallel runs only
    tax_pct: float | None = None
    tax_ms: float | None = None  # ... in ms per step past the first
    comms: pd.DataFrame = field(default_factory=pd.DataFrame)  # comm_stats: DDP ranks
    fsdp: pd.DataFrame = field(default_factory=pd.DataFrame)  # views.fsdp.fsdp_collective_table: FSDP ranks
    gpu: pd.DataFrame = field(default_factory=pd.DataFrame)  # queries.gpu_time: imported traces with GPUs
    outliers: pd.DataFrame = field(default_factory=pd.DataFrame)  # queries.outlier_steps: a long run's, marked
    waits: CollectiveWaitView | None = None  # collective_wait_view: runs of two or more ranks with collectives
    # recorded with the DataLoader watch on and no DataLoader iterated (dpprof.loaders.none_iterated): its data part
    # and its time between steps are the script's own work, not loading
    no_data_loader: bool = False


@dataclass
class CollectiveWaitView:
    """The wait inside the collectives (dpprof.findings.collectives), rank by step: what the heatmap draws."""

    heatmap: pd.DataFrame  # ms a rank waited inside its collectives (rows "rank:N") per step (columns); empty: none matched
    notes: list[str]  # ranks absent from the job, ranks with other numbers of collectives, ...


def collective_wait_view(run: StoredRun) -> CollectiveWaitView | None:
    """Each rank's wait inside its collectives per step, matched across the ranks one rank file at a time (bounded
    memory: dpprof.findings.collectives.match_collectives); None for a run of one rank or with no collectives, an
    empty heatmap with the notes saying why where no collective could be matched."""
    model = run.model
    if run.ranks < 2 or "comms" not in model.has:
        return None
    waits = match_collectives(lambda: rank_collectives(run))
    if waits.per_step.empty and not waits.notes:
        return None
    notes = [*waits.notes]
    if model.world_size and run.ranks < model.world_size:
        notes.insert(0, f"{run.ranks} of {model.world_size} ranks present: each wait is among them (a rank whose file "
                        "is not here may be the one they all wait for)")
    devices = {int(r): f"rank:{int(r)}" for r in waits.counts["rank"]}
    return CollectiveWaitView(heatmap=wait_heatmap(waits.per_step, devices), notes=notes)


# A device's memory figure, by the column of queries.memory_peaks it is read from, in words.
MEMORY_SOURCES = {"peak_allocated_bytes": "peak allocated (CUDA allocator)",
                  "peak_held_bytes": "peak held in one step (dpprof's accounting)"}


def memory_figure(memory: pd.DataFrame) -> str:
    """The column of a run's queries.memory_peaks that is each device's memory figure: the CUDA allocator's peak
    allocated where the run recorded it for any device, else what dpprof accounts to the device in its peak step."""
    use_alloc = bool(len(memory) and memory["peak_allocated_bytes"].notna().any())
    return "peak_allocated_bytes" if use_alloc else "peak_held_bytes"


def glance(run: StoredRun, stats: dict[str, Any] | None = None, found: Findings | None = None) -> Glance:
    """Each device's median work per step and peak memory, idle devices as zero, and the device to blame named
    exactly where the straggler finding names it (the findings' verdict, ``found.straggler``: its medians are the
    bars, its wait the headline's).

    Args:
        found: run_findings(run), if the caller has it already.
    """
    model = run.model
    stats = queries.run_stats(run) if stats is None else stats
    found = run_findings(run) if found is None else found
    verdict = found.straggler
    order = list(model.devices)
    by_device = pd.DataFrame(index=pd.Index(order, name="device"))
    if verdict is not None:
        by_device["work_ms"] = verdict.found.medians.reindex(order)
    else:  # one device, or under three steps: its medians without a verdict
        samples = queries.work_samples(run, skip_first=True)
        table = samples.pivot_table(index="step", columns="device", values="duration_ms") if len(samples) else None
        by_device["work_ms"] = table.median().reindex(order) if table is not None and len(table) else float("nan")
    memory = queries.memory_peaks(run, detail=False)
    col = memory_figure(memory)
    by_device["peak_bytes"] = memory.set_index("device")[col].reindex(order) if len(memory) else float("nan")
    by_device["output_device"] = (memory.set_index("device")["output_device"].reindex(order).fillna(False).astype(bool)
                                  if len(memory) else False)
    idle = list(model.idle)
    by_device["idle"] = by_device.index.isin(idle)
    by_device.loc[by_device["idle"], ["work_ms", "peak_bytes"]] = 0.0
    has_memory = bool(by_device["peak_bytes"].fillna(0).gt(0).any())
    source = MEMORY_SOURCES[col] if has_memory else None
    work = verdict.work if verdict is not None else model.work.label  # what the bars are the medians of
    sentences: list[str] = []
    slowest = fastest = None
    ratio = wait = share = None
    uneven = False
    if verdict is not None:
        slowest, fastest, ratio, wait = verdict.slowest, verdict.found.fastest, verdict.ratio, verdict.wait_ms
        share = verdict.wait_share
        uneven = verdict.reported
        sentences.append(verdict.sentence())
    elif stats["steps"] and by_device.loc[~by_device["idle"], "work_ms"].isna().all():  # no bars to draw: say why
        sentences.append(f"No {work} per {model.unit} to compare: the medians leave out the first step (its one-time "
                         f"costs), and the run has {plural(int(stats['steps']), 'step')}.")
    heaviest = lightest = None
    memory_ratio = None
    memory_uneven = False
    # the devices the batch is spread over, as the memory-skew rule weighs them: not the host an output_device -1
    # gathers onto, whose bytes are said beside them
    peaks = by_device.loc[~by_device["idle"] & by_device.index.isin(model.spread), "peak_bytes"].dropna()
    peaks = peaks[peaks > 0]
    host = by_device["peak_bytes"].get(HOST_OUTPUT)
    # the memory-skew finding is the one verdict on memory: the headline marks its device with its figures, or says
    # why no device is marked; the fullest and the emptiest are facts beside it
    skew = found.table[found.table["kind"] == "memory_skew"]
    if len(peaks) >= 2:
        heaviest, lightest = str(peaks.idxmax()), str(peaks.idxmin())
        memory_ratio = float(peaks.max() / peaks.min())
        if len(skew):
            row = skew.iloc[0]
            memory_uneven, heaviest = True, str(row["device"])
            memory_ratio = float(row["value"])  # over the others' average, as the finding measures it
            title = str(row["title"])
            sentences.append(f"{title[0].upper()}{title[1:]}: {str(row['evidence']).split(';')[0]}.")
        elif peaks.max() == peaks.min():  # no device the fullest: none is compared with itself
            said = f"Memory: {mib(peaks.max())} on each {model.unit}"
        else:
            said = (f"Memory: {mib(peaks.min())} to {mib(peaks.max())} per {model.unit} ({heaviest} the fullest, "
                    f"{memory_ratio:.2f}x {lightest})")
        if not len(skew):
            if model.dataparallel and found.withheld:  # the rule never ran: its figures may be over its thresholds
                said += f"; no memory verdict: {found.scope}"
            elif model.dataparallel:  # the memory-skew rule, as it was made (other kinds have no such rule to miss)
                said += (f"; no memory skew: the output device (the fullest where nothing is gathered) holds under "
                         f"{MEMORY_SKEW_RATIO:.2f}x the others' average, or under {mib(MEMORY_FLOOR_BYTES)} more")
            if host is not None and pd.notna(host):
                said += f"; the host (output_device -1) holds the gathered outputs: {mib(host)}"
            sentences.append(said + ".")
    elif not has_memory and model.missing.get("memory") and model.kind != "empty":
        sentences.append((model.missing.get("allocator") if model.imported else None) or model.missing["memory"])
    if idle:
        sentences.append(f"{', '.join(idle)} got no chunk in any step: idle (the batch is smaller than the devices "
                         "times torch.chunk's chunk).")
    return Glance(devices=by_device.reset_index(), work_phase=work, memory_source=source, slowest=slowest,
                  fastest=fastest, time_ratio=ratio, wait_ms=wait, time_uneven=uneven, heaviest=heaviest,
                  lightest=lightest, memory_ratio=memory_ratio, memory_uneven=memory_uneven, idle=idle,
                  sentences=sentences, from_collectives=verdict is not None and verdict.collectives is not None,
                  wait_share=share)


def comm_stats(run: StoredRun) -> pd.DataFrame:
    """Per rank: its collectives per step (a recorded DDP run's gradient buckets' all-reduce; an imported trace's
    collective kernels, named: all-reduce, reduce-scatter, all-to-all...), the bytes they sent, the time they were
    busy (ddp.collective_busy: their union clipped to the step, never over the step) and the share of it that
    overlapped backward compute, over the steps past the first (ddp.later_collectives: the first is DDP's start-up)
    whose detail stands for the run (every step, or a long run's sample: RunModel.sampled_steps_sql). Empty without collective records; the bytes are NaN where the collectives'
    sizes are not known (a trace profiled without record_shapes). buckets_per_step is the median over the steps past
    the first (ddp.bucket_counts), the bucket finding's count.

    Returns:
        columns device, collectives (their names, most time first), steps, buckets_per_step, sent_per_step_bytes,
        busy_ms, overlap_pct.
    """
    cols = ["device", "collectives", "steps", "buckets_per_step", "sent_per_step_bytes", "busy_ms", "overlap_pct"]
    if "comms" not in run.model.has:
        return pd.DataFrame(columns=cols)
    every, steps, compute = queries.sampled_comm_rows(run)  # a long run: the steps whose detail stands for it
    every, _ = split_script_comms(every)  # DDP's buckets and FSDP's collectives: the script's own are no bucket
    if every.empty:
        return pd.DataFrame(columns=cols)
    comms = later_collectives(every)  # the steps past the first, as the communication finding's
    busy = collective_busy(comms, steps).set_index(["step", "device"])
    kinds = [k for k in busy.columns if k not in ("window_ms", "busy_ms")]
    overlap = overlapped_ms(comms, compute)
    rows = []
    for (step, device), c in comms.groupby(["step", "device"]):
        rows.append({"device": device, "step": step,
                     # unknown (NaN), not 0, where no collective's size is known (a trace without record_shapes)
                     "bytes": pd.to_numeric(c["bucket_bytes"]).sum(min_count=1),
                     "busy": busy["busy_ms"].get((step, device), 0.0),
                     "overlap": overlap[(step, device)]})
    per = pd.DataFrame(rows).groupby("device").agg(steps=("step", "count"), sent_per_step_bytes=("bytes", "mean"),
                                                   busy_ms=("busy", "mean"), overlap=("overlap", "mean"))
    # the bucket finding's count: each rank's median over the steps past the first (the first broadcasts the model)
    per["buckets_per_step"] = bucket_counts(every).groupby("device").median()  # it takes the later steps itself
    per["overlap_pct"] = (100 * per["overlap"] / per["busy_ms"].where(per["busy_ms"] > 0)).clip(upper=100)
    names = comms.groupby("device")["collective"].agg(set)
    per["collectives"] = [", ".join(k for k in kinds if k in names.get(d, set())) for d in per.index]
    per = per.reindex([d for d in run.model.devices if d in per.index])
    return per.reset_index()[cols]


def overview(run: StoredRun) -> Overview:
    """The per-device picture, step time, the phase breakdown per step, the sections of the run's kind and its
    findings."""
    model = run.model
    stats = queries.run_stats(run)
    totals = queries.phase_totals(run, stats)
    steps = queries.step_times(run)
    found = run_findings(run)
    data = Overview(model=model, glance=glance(run, stats, found), stats=stats, throughput=queries.throughput(run),
                    steps=steps,
                    breakdown=queries.phase_breakdown(run, steps=steps), totals=totals, findings=found,
                    outliers=queries.outlier_steps(run), no_data_loader=none_iterated(run.data_loaders()))
    if found.tax is not None:  # the figure the tax finding states, per step past the first
        data.tax_pct, data.tax_ms = 100 * found.tax.share, found.tax.ms
    if "comms" in model.has:
        data.comms = comm_stats(run)
        data.waits = collective_wait_view(run)
    if model.fsdp_phases:
        data.fsdp = fsdp_collective_table(run)
    if "gpu_time" in model.has:
        data.gpu = queries.gpu_time(run)
    return data
