"""What each dashboard page shows, as DataFrames and sentences: composed from the store's queries,
the analysis and the findings. No Streamlit here (the app caches and lays these out), no plotting
(dpprof.charts draws them).

Example:
    >>> run = dpprof.load_run("20261122-080557")
    >>> data = overview(run)
    >>> charts.step_times(data.steps)
"""
from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dpprof.export import meta_frame, to_csv_bytes
from dpprof.findings import FINDING_COLUMNS, FINDINGS_MIN_STEPS, findings_withheld, run_findings
from dpprof.report import findings_of, summary_of
from dpprof.store import queries
from dpprof.store.queries import DP_TAX_PHASES
from dpprof.store.reader import TABLES, StoredRun

__all__ = ["EVEN_RATIO", "FINDINGS_FULL_STEPS", "TIMELINE_DEFAULT_STEPS", "TABLE_DESCRIPTIONS", "Overview", "Load",
           "Comparison", "ComparePart", "Glance", "glance", "display_table", "default_compare", "is_balanced",
           "overview", "load", "findings", "gpu_missing_reason", "trace_memory_text", "gpu_time", "GPU_TIME_PARTS",
           "step_bounds", "default_timeline_range", "timeline", "compare", "compare_part", "combine", "run_label",
           "export_tables", "table_csv", "run_zip"]

# Up to this many steps, findings come from every record (well under a second); beyond it a finished
# run shows the findings stored when it closed, and a running one those of its last this-many steps.
FINDINGS_FULL_STEPS = 5_000
TIMELINE_DEFAULT_STEPS = 5  # a few steps show each phase wide enough to read


@dataclass
class Glance:
    """Each device's work and memory side by side: which device is the problem, at first glance.

    ``devices`` has one row per device of the run, idle ones included (zero, ``idle`` True): device,
    work_ms (mean per step of ``work_phase``), peak_bytes (the allocator's peak allocated where recorded,
    else what dpprof accounts to the device in its peak step), output_device, idle.
    """

    devices: pd.DataFrame
    work_phase: str  # "apply", or a DDP rank's "forward + backward_compute"
    memory_source: str  # "peak allocated (CUDA allocator)" or "peak held in one step (dpprof's accounting)"
    slowest: str | None  # the device with the longest mean work, when two or more devices worked
    fastest: str | None
    time_ratio: float | None  # slowest / fastest mean work
    heaviest: str | None  # the device holding the most memory
    lightest: str | None
    memory_ratio: float | None  # heaviest / lightest peak
    idle: list[str]  # devices of the run that never got a chunk
    sentences: list[str]  # the above, in words

    def marked(self) -> tuple[str | None, str | None]:
        """The slowest and the heaviest device to mark, each None where the devices are within EVEN_RATIO."""
        return (self.slowest if (self.time_ratio or 0) >= EVEN_RATIO else None,
                self.heaviest if (self.memory_ratio or 0) >= EVEN_RATIO else None)


@dataclass
class Overview:
    """The Overview page of one run."""

    glance: Glance
    stats: dict[str, Any]
    steps: pd.DataFrame  # queries.step_times
    breakdown: pd.DataFrame  # queries.phase_breakdown
    totals: pd.DataFrame  # queries.phase_totals
    tax_pct: float | None  # scatter + replicate + gather, % of step time
    tax_ms: float | None  # ... in ms per step
    findings: pd.DataFrame
    findings_scope: str  # where the findings come from, in words
    gathers: bool = True  # False for a balanced run: nothing was gathered onto one device
    balanced: bool = False  # recorded with DataParallelModel + DataParallelCriterion


@dataclass
class Load:
    """The Per-GPU load page of one run."""

    apply_samples: pd.DataFrame
    apply_stats: pd.DataFrame
    memory: pd.DataFrame
    chunks: pd.DataFrame
    gpu: pd.DataFrame
    idle: list[str] = field(default_factory=list)  # devices of the run that never got a chunk (drawn as zero)
    work_phase: str = "apply"  # each device's share of the work: "apply", or a DDP rank's "forward + backward_compute"
    missing: dict[str, str] = field(default_factory=dict)  # "allocator" / "gpu" / "memory" / "apply" -> why not


@dataclass
class Comparison:
    """Two or more runs side by side, and what differs, in sentences."""

    summary: pd.DataFrame  # one row per run
    steps: pd.DataFrame  # run, step, duration_ms
    shares: pd.DataFrame  # run, phase, share_pct, per_step_ms
    memory: pd.DataFrame  # run, device, output_device, peak_held_bytes, peak_allocated_bytes
    differences: list[str]


def _nan_to_none(value: Any) -> Any:
    return None if value is None or (isinstance(value, float) and pd.isna(value)) else value


def findings(run: StoredRun, steps: int | None = None) -> tuple[pd.DataFrame, str]:
    """The run's findings, worst first, and where they come from in words."""
    steps = queries.run_stats(run)["steps"] if steps is None else steps
    running = run.meta["status"] == "running"
    if not steps:
        return pd.DataFrame(columns=FINDING_COLUMNS), "no steps recorded yet"
    if steps < FINDINGS_MIN_STEPS:
        why = findings_withheld(run.query("SELECT step FROM steps"))
        return pd.DataFrame(columns=FINDING_COLUMNS), why
    if steps <= FINDINGS_FULL_STEPS:
        return findings_of(run), f"from all {steps:,} steps" + (" so far" if running else "")
    if run.meta["status"] == "finished":
        return run.findings, f"stored when the run finished, from all {steps:,} steps"
    frames = queries.last_steps_frames(run, FINDINGS_FULL_STEPS)
    found = run_findings(frames["steps"], frames["phases"], frames["memory"], frames["allocator"],
                         frames["gpu_samples"], list(run.meta.get("devices") or []), comms=frames["comms"])
    return found, f"from the last {FINDINGS_FULL_STEPS:,} of {steps:,} steps"


def idle_devices(run: StoredRun) -> list[str]:
    """The devices of the run that never got a chunk (a batch smaller than the devices), in device_ids order."""
    if len(getattr(run, "paths", None) or [run.path]) > 1:
        return []  # a distributed run's ranks all step; their devices are named by rank
    worked = set(queries.devices_of(run))
    return [d for d in run.meta.get("devices") or [] if d not in worked] if worked else []


def _ratio(values: pd.Series) -> tuple[str | None, str | None, float | None]:
    """(largest's device, smallest's device, largest / smallest) over the devices with a positive value."""
    values = values[values > 0].dropna()
    if len(values) < 2:
        return (values.idxmax() if len(values) else None), None, None
    return values.idxmax(), values.idxmin(), float(values.max() / values.min())


# Devices within 5% of each other are even: no device is marked as the worst (thread scheduling on CPU
# workers alone moves apply times by a few percent).
EVEN_RATIO = 1.05


def _mib(value: float) -> str:
    if value >= 2**30:
        return f"{value / 2**30:,.2f} GiB"
    return f"{value / 2**20:,.1f} MiB" if value >= 2**20 else f"{value / 2**10:,.1f} KiB"


def glance(run: StoredRun, stats: dict[str, Any] | None = None) -> Glance:
    """Each device's mean work per step and peak memory, idle devices as zero, and the worst device named."""
    stats = queries.run_stats(run) if stats is None else stats
    work_phase = " + ".join(queries.work_phases(queries.present_phases(run)))
    apply = queries.apply_stats(run, percentiles=False, stats=stats)
    memory = queries.memory_peaks(run, detail=False)
    idle = idle_devices(run)
    order = [*queries.devices_of(run)]
    order += [d for d in idle if d not in order]
    by_device = pd.DataFrame(index=pd.Index(order, name="device"))
    by_device["work_ms"] = apply.set_index("device")["apply_mean_ms"].reindex(order) if len(apply) else float("nan")
    use_alloc = len(memory) and memory["peak_allocated_bytes"].notna().any()
    col = "peak_allocated_bytes" if use_alloc else "peak_held_bytes"
    by_device["peak_bytes"] = memory.set_index("device")[col].reindex(order) if len(memory) else float("nan")
    by_device["output_device"] = (memory.set_index("device")["output_device"].reindex(order).fillna(False).astype(bool)
                                  if len(memory) else False)
    by_device["idle"] = by_device.index.isin(idle)
    by_device.loc[by_device["idle"], ["work_ms", "peak_bytes"]] = 0.0
    slowest, fastest, time_ratio = _ratio(by_device["work_ms"].astype(float))
    heaviest, lightest, memory_ratio = _ratio(by_device["peak_bytes"].astype(float))
    sentences = []
    if time_ratio is not None and time_ratio < EVEN_RATIO:
        sentences.append(f"{work_phase.capitalize()} time is even: every device within {time_ratio - 1:.0%} of "
                         f"{fastest}'s {by_device.at[fastest, 'work_ms']:.2f} ms per step.")
    elif time_ratio is not None:
        sentences.append(f"{slowest} is the slowest: {work_phase} {by_device.at[slowest, 'work_ms']:.2f} ms per step, "
                         f"{time_ratio:.2f}x {fastest}'s {by_device.at[fastest, 'work_ms']:.2f} ms "
                         f"({time_ratio - 1:.0%} longer).")
    if memory_ratio is not None and memory_ratio < EVEN_RATIO:
        sentences.append(f"Memory is even: every device within {memory_ratio - 1:.0%} of "
                         f"{_mib(by_device.at[lightest, 'peak_bytes'])}.")
    elif memory_ratio is not None:
        sentences.append(f"{heaviest} holds the most: {_mib(by_device.at[heaviest, 'peak_bytes'])}, "
                         f"{memory_ratio:.2f}x {lightest}'s {_mib(by_device.at[lightest, 'peak_bytes'])}"
                         + (" (the output device: gathered outputs and the loss live there)."
                            if by_device.at[heaviest, "output_device"] else "."))
    if idle:
        sentences.append(f"{', '.join(idle)} got no chunk in any step: idle (the batch is smaller than the devices "
                         "times torch.chunk's chunk).")
    source = ("peak allocated (CUDA allocator)" if use_alloc else "peak held in one step (dpprof's accounting)")
    return Glance(devices=by_device.reset_index(), work_phase=work_phase, memory_source=source, slowest=slowest,
                  fastest=fastest, time_ratio=time_ratio, heaviest=heaviest, lightest=lightest,
                  memory_ratio=memory_ratio, idle=idle, sentences=sentences)


def overview(run: StoredRun) -> Overview:
    """The per-device picture, step time, the phase breakdown per step, the DataParallel tax and the findings."""
    stats = queries.run_stats(run)
    totals = queries.phase_totals(run, stats)
    tax_pct = tax_ms = None
    if not totals.empty:
        tax = totals[totals["phase"].isin(DP_TAX_PHASES)]
        tax_pct, tax_ms = _nan_to_none(float(tax["share_pct"].sum())), float(tax["per_step_ms"].sum())
    found, scope = findings(run, stats["steps"])
    present = queries.present_phases(run)
    return Overview(glance=glance(run, stats), stats=stats, steps=queries.step_times(run),
                    breakdown=queries.phase_breakdown(run), totals=totals, tax_pct=tax_pct, tax_ms=tax_ms,
                    findings=found, findings_scope=scope, gathers="gather" in present or not present,
                    balanced=is_balanced(run.meta))


def is_balanced(meta: dict[str, Any]) -> bool:
    """Whether a run was recorded with the balanced model and criterion (``dpprof profile --balanced``)."""
    return bool((meta.get("workload_args") or {}).get("balanced"))


def gpu_missing_reason(run: StoredRun) -> str:
    """Why a run has no GPU samples, in words (from the notes the recorder left, else from its backend)."""
    notes = run.query("SELECT message FROM notes WHERE source = 'nvml' ORDER BY t_ms")["message"].tolist()
    if run.meta.get("backend") == "cpu":
        base = "This run used CPU workers: there are no GPUs to sample."
    else:
        base = "No GPU samples were recorded for this run."
    return base + (f" The recorder noted: {'; '.join(notes)}." if notes else "")


def load(run: StoredRun) -> Load:
    """Apply time distributions, memory, chunk sizes and GPU samples per device of one run."""
    samples = queries.apply_samples(run)
    stats = queries.apply_stats(run, samples)
    chunks = queries.chunk_counts(run)
    memory = queries.memory_peaks(run, chunks)
    data = Load(apply_samples=samples, apply_stats=stats, memory=memory, gpu=queries.gpu_series(run),
                chunks=chunks.dropna(subset=["chunk_size"]).reset_index(drop=True),  # calls without a batch: no chunk
                idle=idle_devices(run), work_phase=" + ".join(queries.work_phases(queries.present_phases(run))))
    if stats.empty:
        data.missing["apply"] = f"No {data.work_phase} phases recorded yet: no forward call has finished."
    if memory.empty and run.meta.get("source") == "trace":
        data.missing["memory"] = trace_memory_text(run)
    elif memory.empty:
        data.missing["memory"] = "No memory records yet: no forward call has finished."
    elif memory["peak_allocated_bytes"].isna().all():
        data.missing["allocator"] = ("Peak allocated and reserved bytes come from the CUDA caching allocator; "
                                     + ("this run used CPU workers, which have none, so the chart shows what dpprof "
                                        "accounts to each device (chunk, outputs, activations, gathered outputs, "
                                        "weights)." if run.meta.get("backend") == "cpu"
                                        else "none were recorded for this run."))
    if data.gpu.empty:
        data.missing["gpu"] = gpu_missing_reason(run)
    return data


GPU_TIME_PARTS = ("computation_ms", "overlapping_ms", "communication_ms", "memcpy_ms", "memset_ms", "idle_ms")


def gpu_time(run: StoredRun) -> pd.DataFrame:
    """Mean ms per step of each GPU (or rank's GPU) by what it ran, from an imported trace's gpu_time table:
    the TensorBoard plugin's Distributed view (computation and communication without their overlap,
    the overlap, copies, memsets, idle). Empty for recorded runs.

    Returns:
        columns device, steps, step_ms, one column per GPU_TIME_PARTS, idle_pct.
    """
    cols = ["device", "steps", "step_ms", *GPU_TIME_PARTS, "idle_pct"]
    table = run.gpu_time  # one row per step and GPU: small; a file written before the table reads it empty
    if table.empty:
        return pd.DataFrame(columns=cols)
    t = table.assign(computation_ms=table["compute_ms"] - table["overlap_ms"], overlapping_ms=table["overlap_ms"],
                     communication_ms=table["communication_ms"] - table["overlap_ms"])
    per = t.groupby("device", as_index=False).agg(
        steps=("step", "count"), step_ms=("window_ms", "mean"),
        **{c: (c, "mean") for c in GPU_TIME_PARTS})
    order = {d: i for i, d in enumerate(run.meta.get("devices") or [])}
    per = per.sort_values("device", key=lambda s: s.map(lambda d: (order.get(d, len(order)), d))).reset_index(drop=True)
    per["idle_pct"] = 100 * per["idle_ms"] / per["step_ms"]
    return per[cols]


def trace_memory_text(run: StoredRun) -> str:
    """What an imported trace says about memory, in words: the allocator's peaks from its [memory] events."""
    text = ("An imported torch.profiler trace has no dpprof accounting of what each device holds (its chunk, "
            "outputs, activations, gathered outputs).")
    peaks = run.query("SELECT device, MAX(peak_allocated_bytes) AS peak, MAX(reserved_bytes) AS reserved "
                      "FROM allocator GROUP BY device").drop(columns=["rank"], errors="ignore")
    if peaks.empty:
        return text + " It has no [memory] events either (recorded without profile_memory=True)."
    parts = [f"{r.device} {r.peak / 2**20:,.1f} MiB" + (f" (reserved {r.reserved / 2**20:,.1f} MiB)"
                                                        if pd.notna(r.reserved) else "")
             for r in peaks.itertuples()]
    return (text + " Its [memory] events give the CUDA allocator's peak allocated bytes: " + "; ".join(parts)
            + ". Per step, they are the allocator table (Export page).")


def step_bounds(run: StoredRun) -> tuple[int | None, int | None]:
    """The run's first and last recorded step (None, None before its first step)."""
    stats = queries.run_stats(run)
    if not stats["steps"]:
        return None, None
    return int(stats["first_step"]), int(stats["last_step"])


def default_timeline_range(run: StoredRun) -> tuple[int, int]:
    """The last TIMELINE_DEFAULT_STEPS steps (all steps of a shorter run)."""
    stats = queries.run_stats(run)
    if not stats["steps"]:
        return 0, 0
    last = int(stats["last_step"])
    return max(int(stats["first_step"]), last - TIMELINE_DEFAULT_STEPS + 1), last


def timeline(run: StoredRun, first_step: int, last_step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phases and steps of a range of steps (see dpprof.store.queries.timeline)."""
    return queries.timeline(run, first_step, last_step)


def run_label(meta: dict[str, Any]) -> str:
    """A short, unique label for a run: its name and the random end of its id."""
    return f"{meta.get('name') or meta['id']} · {meta['id'][-6:]}"


def _times_text(a: float, b: float) -> str:
    """b's time against a's: "0.77x the time (23% faster)"."""
    r = b / a
    change = f" ({1 - r:.0%} faster)" if r < 0.995 else f" ({r - 1:.0%} slower)" if r > 1.005 else ""
    return f"{r:.2f}x the time{change}"


def _bytes_text(a: float, b: float) -> str:
    """b's bytes against a's: "1.20x (20% more)"."""
    r = b / a
    return f"{r:.2f}x" + (f" ({1 - r:.0%} less)" if r < 0.995 else f" ({r - 1:.0%} more)" if r > 1.005 else "")


@dataclass
class ComparePart:
    """One run's share of a comparison (cached per run by the app)."""

    row: dict[str, Any]
    shares: pd.DataFrame
    memory: pd.DataFrame
    steps: pd.DataFrame


def compare_part(run: StoredRun, max_points: int = 1_000) -> ComparePart:
    """What a comparison needs of one run: its summary row, phase shares, memory and step times."""
    stats = queries.run_stats(run)
    totals = queries.phase_totals(run, stats)
    memory = queries.memory_peaks(run, detail=False)
    apply = queries.apply_stats(run, percentiles=False, stats=stats)
    meta = run.meta
    label = run_label(meta)
    share = totals.set_index("phase")["share_pct"] if not totals.empty else pd.Series(dtype=float)
    median, batch = stats["median_step_ms"], stats["batch_size"]
    is_out = memory["output_device"].astype(bool) if not memory.empty else pd.Series(dtype=bool)
    row = {
        "run": label, "id": meta["id"], "status": meta["status"], "backend": meta.get("backend"),
        "devices": len(meta.get("devices") or []), "workload": meta.get("workload"), "steps": stats["steps"],
        "batch_size": batch, "median_step_ms": median, "mean_step_ms": stats["mean_step_ms"],
        "samples_per_s": batch / median * 1e3 if batch and median else None,
        "dp_tax_pct": float(share.reindex(list(DP_TAX_PHASES)).fillna(0).sum()) if len(share) else None,
        "apply_slowest_to_fastest": (apply["apply_mean_ms"].max() / apply["apply_mean_ms"].min()
                                     if len(apply) > 1 and apply["apply_mean_ms"].min() else None),
        "balanced": is_balanced(meta),
        "fullest_device": memory.loc[memory["peak_held_bytes"].idxmax(), "device"] if len(memory) else None,
        "fullest_device_peak_held_bytes": float(memory["peak_held_bytes"].max()) if len(memory) else None,
        "memory_most_to_least": (float(memory["peak_held_bytes"].max() / memory["peak_held_bytes"].min())
                                 if len(memory) > 1 and memory["peak_held_bytes"].min() > 0 else None),
        "output_device_peak_held_bytes": float(memory.loc[is_out, "peak_held_bytes"].max()) if is_out.any() else None,
        "other_devices_peak_held_bytes": (float(memory.loc[~is_out, "peak_held_bytes"].mean())
                                          if (~is_out).any() else None),
    }
    for phase, value in share.items():
        row[f"{phase}_share_pct"] = _nan_to_none(float(value))
    return ComparePart(
        row=row, shares=totals.assign(run=label)[["run", "phase", "share_pct", "per_step_ms"]],
        memory=memory.assign(run=label)[["run", "device", "output_device", "peak_held_bytes", "peak_allocated_bytes"]],
        steps=queries.step_times(run, max_points).assign(run=label)[["run", "step", "duration_ms"]])


def combine(parts: list[ComparePart]) -> Comparison:
    """Runs side by side, the differences stated against the first run (the baseline)."""
    summary = pd.DataFrame([p.row for p in parts])
    return Comparison(summary=summary, steps=pd.concat([p.steps for p in parts], ignore_index=True),
                      shares=pd.concat([p.shares for p in parts], ignore_index=True),
                      memory=pd.concat([p.memory for p in parts], ignore_index=True),
                      differences=_differences(summary))


def compare(runs: list[StoredRun]) -> Comparison:
    """Two or more runs side by side: step time, phase shares, per-device memory, and what differs.

    The differences are stated against the first run (the baseline).
    """
    return combine([compare_part(run) for run in runs])


def _present(value: Any) -> bool:
    return value is not None and not pd.isna(value) and bool(value)


def default_compare(runs: pd.DataFrame, chosen: str | None) -> tuple[list[str], str | None]:
    """The pair Compare opens on: the run open in the sidebar and the newest finished run of the same workload
    (the older first, as the baseline); or no pair and what is needed, in words.

    Args:
        runs: the readable runs of dpprof.list_runs, newest first.
        chosen: the id of the run open in the sidebar.
    """
    match = runs[runs["id"] == chosen]
    if match.empty:
        return [], "Choose a run in the sidebar (or two or more below) to compare."
    row = match.iloc[0]
    if not row["steps"] or pd.isna(row["steps"]):
        return [], (f"The open run, {row['name'] or row['id']}, recorded no steps: there is nothing to compare. "
                    "Choose another run in the sidebar, or runs below.")
    others = runs[(runs["id"] != chosen) & (runs["status"] == "finished") & (runs["steps"].fillna(0) > 0)
                  & (runs["workload"].fillna("") == (row["workload"] or ""))]
    if others.empty:
        return [], (f"Comparing needs a second finished run of {row['workload'] or 'the same model'} besides "
                    f"{row['name'] or row['id']}: record one on the New run page (for example with --balanced or "
                    "another number of devices), or choose runs below.")
    pair = pd.concat([match, others.iloc[[0]]]).sort_values("created_at")
    return pair["id"].tolist(), None


def _differences(summary: pd.DataFrame) -> list[str]:
    """Sentences: how each run differs from the first."""
    if len(summary) < 2:
        return []
    base = summary.iloc[0]
    out = []
    for _, other in summary.iloc[1:].iterrows():
        a, b = base["run"], other["run"]
        if base["devices"] != other["devices"] or base["backend"] != other["backend"]:
            out.append(f"{b} runs on {other['devices']} {other['backend']} device(s), {a} on "
                       f"{base['devices']} {base['backend']} device(s).")
        if base["batch_size"] != other["batch_size"]:
            out.append(f"Batch size: {b} {other['batch_size']}, {a} {base['batch_size']}.")
        if base["median_step_ms"] and other["median_step_ms"]:
            out.append(f"Median step: {b} {other['median_step_ms']:.2f} ms, {a} {base['median_step_ms']:.2f} ms: "
                       f"{b} takes {_times_text(base['median_step_ms'], other['median_step_ms'])}.")
        if base["samples_per_s"] and other["samples_per_s"]:
            out.append(f"Throughput: {b} {other['samples_per_s']:,.0f} samples/s, {a} "
                       f"{base['samples_per_s']:,.0f} samples/s "
                       f"({other['samples_per_s'] / base['samples_per_s'] - 1:+.0%}).")
        deltas = []
        for col in (c for c in summary.columns if c.endswith("_share_pct")):
            phase = col[: -len("_share_pct")]
            x, y = base.get(col), other.get(col)
            x = 0.0 if x is None or pd.isna(x) else x  # a phase one run does not have takes 0% of its step
            y = 0.0 if y is None or pd.isna(y) else y
            deltas.append((abs(y - x), phase, x, y))
        for _, phase, x, y in sorted(deltas, reverse=True)[:2]:
            if abs(y - x) >= 1.0:
                name = {"parallel_apply": "apply (all devices)", "rest": "the rest of the step"}.get(phase, phase)
                name = name[0].upper() + name[1:]
                out.append(f"{name}: {y:.1f}% of {b}'s step, {x:.1f}% of {a}'s ({y - x:+.1f} points).")
        if base["dp_tax_pct"] is not None and other["dp_tax_pct"] is not None:
            out.append(f"DataParallel tax (scatter + replicate + gather): {b} {other['dp_tax_pct']:.1f}%, "
                       f"{a} {base['dp_tax_pct']:.1f}% of the step.")
        x, y = base["output_device_peak_held_bytes"], other["output_device_peak_held_bytes"]
        if _present(x) and _present(y):
            out.append(f"The output device holds {y / 2**20:.1f} MiB in {b}, {x / 2**20:.1f} MiB in {a}: "
                       f"{_bytes_text(x, y)}.")
        elif _present(base["fullest_device_peak_held_bytes"]) and _present(other["fullest_device_peak_held_bytes"]):
            # a balanced run gathers nothing, so it has no output device: compare the fullest devices
            x, y = base["fullest_device_peak_held_bytes"], other["fullest_device_peak_held_bytes"]
            role = lambda r: ", the output device" if _present(r["output_device_peak_held_bytes"]) else ""  # noqa: E731
            out.append(f"The fullest device holds {y / 2**20:.1f} MiB in {b} ({other['fullest_device']}"
                       f"{role(other)}), {x / 2**20:.1f} MiB in {a} ({base['fullest_device']}{role(base)}): "
                       f"{_bytes_text(x, y)}.")
        x, y = base["memory_most_to_least"], other["memory_most_to_least"]
        if _present(x) and _present(y) and abs(x - y) >= 0.05:
            out.append(f"Memory spread (the fullest device over the emptiest): {b} {y:.2f}x, {a} {x:.2f}x.")
        x, y = base["apply_slowest_to_fastest"], other["apply_slowest_to_fastest"]
        if x and y and not pd.isna(x) and not pd.isna(y):
            out.append(f"Slowest device's mean apply over the fastest's: {b} {y:.2f}x, {a} {x:.2f}x.")
    return out


TABLE_DESCRIPTIONS = {
    "steps": "one row per step: start, duration, batch size",
    "phases": "one row per phase of each forward call on each device",
    "memory": "what each device held in each forward call",
    "allocator": ("the CUDA caching allocator after each replica's apply (its device) and after backward "
                  "(every device); peaks count from the step's start (CUDA runs only)"),
    "devices": "the run's devices",
    "gpu_samples": "NVML readings over time (CUDA runs with NVML only)",
    "findings": "the run's findings, worst first",
    "notes": "why some data is missing",
    "comms": "each gradient bucket's all-reduce (DistributedDataParallel runs), or each collective (imported traces)",
    "gpu_time": "per step and GPU: compute, communication, overlap, memcpy, memset and idle time (imported traces)",
}


def export_tables(run: StoredRun) -> pd.DataFrame:
    """The run's tables and their row counts (what the Export page offers)."""
    counts = {t: int(run.query(f"SELECT COUNT(*) FROM {t}").iloc[0, 0]) for t in TABLES if t != "findings"}
    counts["findings"] = None  # computed (or stored) when asked for
    return pd.DataFrame([{"table": t, "rows": counts[t], "what": TABLE_DESCRIPTIONS.get(t, "")} for t in TABLES])


def _table(run: StoredRun, name: str) -> pd.DataFrame:
    if name == "findings":
        return findings(run)[0]
    if name == "run":
        return meta_frame(run.meta)
    if name == "device_summary":
        return summary_of(run).reset_index()
    if name == "phase_totals":
        return queries.phase_totals(run)
    return run.query(f"SELECT * FROM {name}") if name in TABLES else pd.DataFrame()


EXTRA_TABLES = ("run", "device_summary", "phase_totals")


def table_csv(run: StoredRun, name: str) -> bytes:
    """One table of the run as CSV bytes (formula-like cells neutralised)."""
    if name not in TABLES and name not in EXTRA_TABLES:
        raise KeyError(f"no table {name!r}")
    return to_csv_bytes(_table(run, name))


def run_zip(run: StoredRun) -> bytes:
    """The whole run as a zip of CSVs: run.csv, one per table, device_summary.csv, phase_totals.csv."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in (*EXTRA_TABLES[:1], *TABLES, *EXTRA_TABLES[1:]):
            z.writestr(f"{run.id}/{name}.csv", table_csv(run, name))
    return buf.getvalue()


# Column-name endings and the unit people read them in: (ending, unit, scale).
_UNITS = (("_bytes_per_s", "MiB/s", 2**-20), ("_bytes", "MiB", 2**-20), ("_ms", "ms", 1.0), ("_pct", "%", 1.0),
          ("_per_s", "per s", 1.0),
          ("_s", "s", 1.0), ("_w", "W", 1.0), ("_c", "°C", 1.0), ("_mhz", "MHz", 1.0))
DISPLAY_DECIMALS = 2  # a table shows hundredths of a millisecond, a MiB or a percent; CSVs keep every digit


def display_table(df: pd.DataFrame) -> pd.DataFrame:
    """A table as people read it: headers in words with their unit ("apply mean (ms)"), bytes in MiB (GiB
    where a column reaches one), numbers to DISPLAY_DECIMALS places, whole-number columns as integers."""
    out = pd.DataFrame(index=df.index)
    for col in df.columns:
        values, name = df[col], str(col)
        for ending, unit, scale in _UNITS:
            if name.endswith(ending) and pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
                if unit == "MiB" and values.abs().max() >= 2**30:
                    unit, scale = "GiB", 2**-30
                values, name = values * scale, f"{name[: -len(ending)]} ({unit})"
                break
        if pd.api.types.is_float_dtype(values):
            finite = values.dropna()
            whole = len(finite) and (finite == finite.round()).all() and finite.abs().max() < 2**53
            values = values.round().astype("Int64") if whole and _unit_free(name) else values.round(DISPLAY_DECIMALS)
        out[name.replace("_", " ")] = values
    return out


def _unit_free(header: str) -> bool:
    """Whether a display header is a count (no unit in parentheses): such columns show as integers."""
    return not header.endswith(")")
