"""Fast reads for the dashboard: aggregates computed in SQL, long series bucketed to a few thousand points.

A run of 8 devices x 50,000 steps holds about 700,000 phase rows; loading them into pandas to draw
one chart takes seconds, so every function here asks SQLite for what a chart needs (per-step phase
sums, per-device peaks, a sample of apply times, one range of steps) and returns a small DataFrame.
The run file's indices (dpprof.store.schema.INDEXES) let most of these read an index alone; files
written without them give the same answers, more slowly. Missing data is an empty DataFrame with
the documented columns, never an exception.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from dpprof.records import PHASES
from dpprof.store.reader import StoredRun

__all__ = ["MAX_POINTS", "APPLY_SAMPLE_PER_DEVICE", "TIMELINE_MAX_STEPS", "MEMORY_BYTES", "DP_TAX_PHASES",
           "GPU_METRICS", "bucket_width", "present_phases", "stacked_phases", "run_stats", "median_step_ms",
           "step_times", "phase_breakdown", "phase_totals", "apply_samples", "apply_stats", "memory_peaks", "chunk_counts",
           "gpu_series", "timeline", "last_steps_frames", "devices_of", "work_phases"]

MAX_POINTS = 2_000  # points a chart draws per series; a browser stays responsive well past this
APPLY_SAMPLE_PER_DEVICE = 4_000  # enough for box and violin shapes; exact mean, min and max come from SQL
TIMELINE_MAX_STEPS = 100  # a Gantt of more steps than this is unreadable (and slow to draw)

# What a device holds in one forward call, as the memory table records it.
MEMORY_BYTES = ("input_bytes", "output_bytes", "activation_bytes", "gathered_bytes", "param_bytes", "buffer_bytes")
DP_TAX_PHASES = ("scatter", "replicate", "gather")  # work only DataParallel does (DDP has none of it)
# DistributedDataParallel's phases that follow one another within a rank's step (backward is
# backward_compute then comm_wait, when those are recorded).
_DDP_SEQUENCE = ("data", "forward", "backward", "backward_compute", "comm_wait", "optimizer")
_HELD = " + ".join(MEMORY_BYTES)


def bucket_width(first: int, last: int, max_points: int) -> int:
    """Steps per plotted point so that [first, last] fits in max_points points."""
    return max(1, math.ceil((last - first + 1) / max(1, max_points)))


def _ranks(run: StoredRun) -> int:
    """How many files the run has: one, or one per rank of a torch.distributed run."""
    return len(getattr(run, "paths", None) or [run.path])


def _one_row(df: pd.DataFrame, by: str) -> pd.Series:
    """The row of a one-row-per-file aggregate that has data (a device lives in one rank's file)."""
    if len(df) > 1:
        df = df.sort_values(by, ascending=False, na_position="last")
    return df.drop(columns=["rank"], errors="ignore").iloc[0]


def _distinct(run: StoredRun, table: str, column: str) -> list[Any]:
    """SELECT DISTINCT column FROM table, as a loose index scan: one index lookup per value when an
    index leads with the column (dpprof.store.schema.INDEXES), where DISTINCT would read every row."""
    return run.query(
        f"WITH RECURSIVE v(x) AS (SELECT MIN({column}) FROM {table} UNION ALL "
        f"SELECT (SELECT MIN({column}) FROM {table} WHERE {column} > x) FROM v WHERE x IS NOT NULL) "
        "SELECT x FROM v WHERE x IS NOT NULL")["x"].drop_duplicates().tolist()


def present_phases(run: StoredRun) -> list[str]:
    """The phase names this run recorded, in the order a step runs them."""
    names = _distinct(run, "phases", "phase")
    order = {p: i for i, p in enumerate((*PHASES, *_DDP_SEQUENCE))}
    return sorted(names, key=lambda p: (order.get(p, len(order)), p))


def stacked_phases(present: list[str]) -> list[str]:
    """The phases that follow one another in a step (so they stack to at most the step time).

    For DataParallel every phase but ``apply`` (each device's apply runs inside parallel_apply);
    for DistributedDataParallel data, forward, backward (or its parts) and optimizer.
    """
    if "forward" in present:
        parts = "backward_compute" in present
        return [p for p in _DDP_SEQUENCE if p in present and not (parts and p == "backward")]
    return [p for p in present if p != "apply"]


def run_stats(run: StoredRun) -> dict[str, Any]:
    """Step count, first and last step, mean, median and total step time, batch size and devices used."""
    per = run.query("SELECT COUNT(*) AS steps, MIN(step) AS first_step, MAX(step) AS last_step, "
                    "AVG(duration_ms) AS mean_step_ms, SUM(duration_ms) AS total_ms, "
                    "MAX(batch_size) AS batch_size, MAX(devices_used) AS devices_used FROM steps")
    # ranks of a distributed run step together: their steps are the same steps, their batches add up
    row = per.agg({"steps": "max", "first_step": "min", "last_step": "max", "mean_step_ms": "mean",
                   "total_ms": "mean", "batch_size": "sum" if len(per) > 1 else "max", "devices_used": "sum"})
    stats = {k: (None if pd.isna(v) else v.item() if hasattr(v, "item") else v) for k, v in row.items()}
    stats["steps"] = int(stats["steps"] or 0)
    stats["batch_size"] = int(stats["batch_size"]) if stats["batch_size"] else None
    stats["devices_used"] = int(stats["devices_used"]) if stats["devices_used"] else None
    stats["median_step_ms"] = median_step_ms(run) if stats["steps"] else None
    return stats


def median_step_ms(run: StoredRun) -> float | None:
    """The median of every recorded step's duration_ms (the mean of the middle two of an even count): the one
    definition the dashboard and ``dpprof show`` share. Equals ``load_run(...).steps["duration_ms"].median()``.
    A distributed run's rows of every rank count, as its steps table holds them."""
    if _ranks(run) > 1:  # rank files are separate databases: the rows come to pandas
        durations = run.query("SELECT duration_ms FROM steps")["duration_ms"]
        return float(durations.median()) if len(durations) else None
    middle = run.query("SELECT AVG(duration_ms) AS ms FROM (SELECT duration_ms FROM steps ORDER BY duration_ms "
                       "LIMIT 2 - (SELECT COUNT(*) FROM steps) % 2 OFFSET (SELECT (COUNT(*) - 1) / 2 FROM steps))")
    value = middle["ms"].iloc[0]
    return None if pd.isna(value) else float(value)


def step_times(run: StoredRun, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Step time over the run, one row per step or per bucket of consecutive steps.

    Returns:
        columns step (first step of the bucket), steps (in the bucket), duration_ms (mean),
        min_duration_ms, max_duration_ms.
    """
    first, last = _span(run)
    if first is None:
        return pd.DataFrame(columns=["step", "steps", "duration_ms", "min_duration_ms", "max_duration_ms"])
    width = bucket_width(first, last, max_points)
    out = run.query(
        "SELECT (step - ?) / ? AS bucket, MIN(step) AS step, COUNT(*) AS steps, AVG(duration_ms) AS duration_ms, "
        "MIN(duration_ms) AS min_duration_ms, MAX(duration_ms) AS max_duration_ms "
        "FROM steps GROUP BY bucket ORDER BY bucket", (first, width))
    if "rank" in out:  # ranks step together: one point per bucket, the ranks' mean and their extremes
        out = out.groupby("bucket", as_index=False).agg(
            step=("step", "min"), steps=("steps", "max"), duration_ms=("duration_ms", "mean"),
            min_duration_ms=("min_duration_ms", "min"), max_duration_ms=("max_duration_ms", "max"))
    return out.drop(columns="bucket")


def _span(run: StoredRun) -> tuple[int | None, int | None]:
    span = run.query("SELECT MIN(step) AS a, MAX(step) AS b FROM steps")
    if span["a"].isna().all():
        return None, None
    return int(span["a"].min()), int(span["b"].max())


def phase_breakdown(run: StoredRun, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Mean milliseconds per step of each phase that follows another (stacked_phases), and the rest.

    ``parallel_apply`` is the wall time of every device's apply together; ``rest_ms`` is the part of
    the step outside the recorded phases (the optimizer step, loading the batch, Python in between).

    Returns:
        columns step (first of the bucket), steps, step_ms, one ``<phase>_ms`` per stacked phase, rest_ms.
    """
    phases = stacked_phases(present_phases(run))
    cols = ["step", "steps", "step_ms", *[f"{p}_ms" for p in phases], "rest_ms"]
    steps = step_times(run, max_points)
    if steps.empty:
        return pd.DataFrame(columns=cols)
    first, last = _span(run)
    width = bucket_width(first, last, max_points)
    out = steps.rename(columns={"duration_ms": "step_ms"})[["step", "steps", "step_ms"]].copy()
    out.index = (out["step"] - first) // width
    if phases:
        sums = run.query(
            "SELECT (step - ?) / ? AS bucket, phase, SUM(duration_ms) AS ms FROM phases "
            f"WHERE phase IN ({', '.join('?' * len(phases))}) AND step BETWEEN ? AND ? GROUP BY bucket, phase",
            (first, width, *phases, first, last))
        sums = sums.groupby(["bucket", "phase"], as_index=False)["ms"].sum()
        sums["ms"] /= _ranks(run)  # a distributed run: the ranks' mean
        table = sums.pivot(index="bucket", columns="phase", values="ms").reindex(columns=phases)
        per_step = table.reindex(out.index).fillna(0.0).div(out["steps"], axis=0)
    else:
        per_step = pd.DataFrame(index=out.index)
    for phase in phases:
        out[f"{phase}_ms"] = per_step[phase]
    out["rest_ms"] = (out["step_ms"] - per_step.sum(axis=1)).clip(lower=0.0)
    return out.reset_index(drop=True)[cols]


def phase_totals(run: StoredRun, stats: dict[str, Any] | None = None) -> pd.DataFrame:
    """Each phase that follows another: its total, its mean per step and its share of the step time,
    and the rest of the step.

    Args:
        stats: run_stats(run), if the caller has it already.

    Returns:
        columns phase, total_ms, per_step_ms, share_pct; one row per stacked phase and "rest".
    """
    stats = run_stats(run) if stats is None else stats
    cols = ["phase", "total_ms", "per_step_ms", "share_pct"]
    if not stats["steps"]:
        return pd.DataFrame(columns=cols)
    phases = stacked_phases(present_phases(run))
    sums = pd.Series(dtype=float)
    if phases:
        sums = run.query(
            f"SELECT phase, SUM(duration_ms) AS total_ms FROM phases WHERE phase IN ({', '.join('?' * len(phases))}) "
            "AND step BETWEEN ? AND ? GROUP BY phase",
            (*phases, stats["first_step"], stats["last_step"])).groupby("phase")["total_ms"].sum() / _ranks(run)
    totals = sums.reindex(phases).fillna(0.0)
    totals["rest"] = max(0.0, stats["total_ms"] - totals.sum())
    out = totals.rename("total_ms").rename_axis("phase").reset_index()
    out["per_step_ms"] = out["total_ms"] / stats["steps"]
    out["share_pct"] = 100 * out["total_ms"] / stats["total_ms"] if stats["total_ms"] else float("nan")
    return out[cols]


def work_phases(present: list[str]) -> tuple[str, ...]:
    """The phases that are each device's own share of the work: DataParallel's apply; a DDP rank's
    forward and backward compute."""
    if "apply" in present or "forward" not in present:
        return ("apply",)
    return ("forward", "backward_compute") if "backward_compute" in present else ("forward",)


def _phase_in(phases: tuple[str, ...]) -> str:
    return f"phase IN ({', '.join('?' * len(phases))})"


def devices_of(run: StoredRun) -> list[str]:
    """The devices that did work in the run, in device_ids order (others after)."""
    seen = _distinct(run, "memory", "device") or _distinct(run, "phases", "device")
    listed = [d for d in run.meta.get("devices") or [] if d in seen]
    return listed + sorted((d for d in seen if d not in listed), key=lambda d: (len(d), d))


def apply_samples(run: StoredRun, per_device: int = APPLY_SAMPLE_PER_DEVICE) -> pd.DataFrame:
    """Apply milliseconds per step on each device (forward calls summed); past per_device steps,
    every k-th step only, so each device has about per_device values.

    Returns:
        columns step, device, duration_ms.
    """
    first, last = _span(run)
    if first is None:
        return pd.DataFrame(columns=["step", "device", "duration_ms"])
    stride = bucket_width(first, last, per_device)
    phases = work_phases(present_phases(run))
    out = run.query("SELECT step, device, SUM(duration_ms) AS duration_ms FROM phases "
                    f"WHERE {_phase_in(phases)} AND step % ? = 0 GROUP BY device, step", (*phases, stride))
    out = out.drop(columns=["rank"], errors="ignore")
    order = {d: i for i, d in enumerate(devices_of(run))}
    return out.sort_values(["device", "step"], key=lambda s: s.map(order) if s.name == "device" else s,
                           kind="stable").reset_index(drop=True)


def apply_stats(run: StoredRun, samples: pd.DataFrame | None = None, percentiles: bool = True,
                stats: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per device: apply steps, mean, min and max over every step (forward calls summed), p50 and p95
    (of ``samples``, default apply_samples(run): exact up to APPLY_SAMPLE_PER_DEVICE steps, from every
    k-th step beyond), and the mean apply's share of the mean step.

    Args:
        samples: apply_samples(run), if the caller has it already.
        percentiles: False leaves p50 and p95 out (NaN), which saves reading the samples.
        stats: run_stats(run), if the caller has it already.

    Returns:
        columns device, steps, apply_mean_ms, apply_min_ms, apply_max_ms, apply_p50_ms, apply_p95_ms,
        apply_share_of_step_pct, sampled (True when the percentiles come from every k-th step).
    """
    cols = ["device", "steps", "apply_mean_ms", "apply_min_ms", "apply_max_ms", "apply_p50_ms", "apply_p95_ms",
            "apply_share_of_step_pct", "sampled"]
    rows = []
    phases = work_phases(present_phases(run))
    for device in devices_of(run):  # one device at a time: SQLite walks the index, never sorts
        r = _one_row(run.query("SELECT COUNT(*) AS steps, AVG(ms) AS apply_mean_ms, MIN(ms) AS apply_min_ms, "
                               "MAX(ms) AS apply_max_ms FROM (SELECT SUM(duration_ms) AS ms FROM phases "
                               f"WHERE {_phase_in(phases)} AND device = ? GROUP BY step)", (*phases, device)),
                     "steps")
        if r["steps"]:
            rows.append({"device": device, **r.to_dict()})
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows)
    out["steps"] = out["steps"].astype(int)
    out["apply_p50_ms"] = out["apply_p95_ms"] = float("nan")
    out["sampled"] = False
    if percentiles:
        samples = apply_samples(run) if samples is None else samples
        q = samples.groupby("device")["duration_ms"].quantile([0.5, 0.95]).unstack()
        out["apply_p50_ms"] = out["device"].map(q[0.5])
        out["apply_p95_ms"] = out["device"].map(q[0.95])
        out["sampled"] = out["device"].map(samples.groupby("device").size()).fillna(0) < out["steps"]
    mean_step = (run_stats(run) if stats is None else stats)["mean_step_ms"]
    out["apply_share_of_step_pct"] = 100 * out["apply_mean_ms"] / mean_step if mean_step else float("nan")
    return out[cols]


def chunk_counts(run: StoredRun) -> pd.DataFrame:
    """How many forward calls gave each device each chunk size (None: a call without a batch
    dimension, such as a whole-batch loss).

    Returns:
        columns device, chunk_size, calls.
    """
    parts = [run.query("SELECT ? AS device, chunk_size, COUNT(*) AS calls FROM memory WHERE device = ? "
                       "GROUP BY chunk_size ORDER BY chunk_size", (device, device)) for device in devices_of(run)]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["device", "chunk_size", "calls"])
    out = pd.concat(parts, ignore_index=True).drop(columns=["rank"], errors="ignore")
    return out.astype({"chunk_size": float, "calls": int})


def memory_peaks(run: StoredRun, chunks: pd.DataFrame | None = None, detail: bool = True) -> pd.DataFrame:
    """Per device: its peak step (the most dpprof accounts to it in one step, forward calls summed),
    what it held then by kind, its chunk sizes, and the CUDA allocator's peaks.

    Args:
        chunks: chunk_counts(run), if the caller has it already.
        detail: False leaves the kinds and chunk sizes out (NaN): peaks and the output device only.

    Returns:
        columns device, output_device (True for the device gathered outputs landed on), peak_step,
        peak_held_bytes, one column per MEMORY_BYTES (at the peak step), chunk_size_mean,
        chunk_size_min, chunk_size_max, peak_allocated_bytes and peak_reserved_bytes (NaN without
        allocator records: CPU workers).
    """
    cols = ["device", "output_device", "peak_step", "peak_held_bytes", *MEMORY_BYTES, "chunk_size_mean",
            "chunk_size_min", "chunk_size_max", "peak_allocated_bytes", "peak_reserved_bytes"]
    rows = []
    for device in devices_of(run):
        # SQLite gives the bare column (step) of the row holding the one MAX(): the peak step
        peak = _one_row(run.query(
            f"SELECT step, MAX(held) AS held, SUM(gathered) AS gathered FROM (SELECT step, SUM({_HELD}) AS held, "
            "SUM(gathered_bytes) AS gathered FROM memory WHERE device = ? GROUP BY step)", (device,)), "held")
        if pd.isna(peak["held"]):
            continue
        kinds = (_one_row(run.query(f"SELECT {', '.join(f'SUM({c}) AS {c}' for c in MEMORY_BYTES)} FROM memory "
                                    "WHERE device = ? AND step = ?", (device, int(peak["step"]))), MEMORY_BYTES[0])
                 if detail else dict.fromkeys(MEMORY_BYTES, float("nan")))
        gathered = peak["gathered"]
        alloc = run.query("SELECT MAX(peak_allocated_bytes) AS b FROM allocator WHERE device = ?", (device,))["b"].max()
        reserved = run.query("SELECT MAX(reserved_bytes) AS b FROM allocator WHERE device = ?", (device,))["b"].max()
        rows.append({"device": device, "peak_step": int(peak["step"]), "peak_held_bytes": float(peak["held"]),
                     **{c: float(kinds[c]) for c in MEMORY_BYTES}, "_gathered": gathered or 0,
                     "peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved})
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows)
    out["output_device"] = (out["_gathered"] == out["_gathered"].max()) & (out["_gathered"] > 0)
    if chunks is None:
        chunks = chunk_counts(run) if detail else pd.DataFrame(columns=["device", "chunk_size", "calls"])
    sized = chunks.dropna(subset=["chunk_size"]).astype({"chunk_size": float, "calls": float})
    weighted = sized.assign(total=sized["chunk_size"] * sized["calls"]).groupby("device")
    out["chunk_size_mean"] = out["device"].map(weighted["total"].sum() / weighted["calls"].sum())
    out["chunk_size_min"] = out["device"].map(sized.groupby("device")["chunk_size"].min())
    out["chunk_size_max"] = out["device"].map(sized.groupby("device")["chunk_size"].max())
    out = out.astype({"peak_allocated_bytes": float, "peak_reserved_bytes": float})
    return out[cols]


GPU_METRICS = ("gpu_util_pct", "memory_util_pct", "memory_used_bytes", "memory_total_bytes", "power_w",
               "power_limit_w", "temperature_c", "sm_clock_mhz")


def gpu_series(run: StoredRun, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """NVML samples over time per GPU, averaged over buckets of time so each GPU has at most max_points.

    Returns:
        columns t_ms (bucket start), device, samples, and the mean of each GPU metric (NaN where NVML
        had no value); empty when the run has no GPU samples (CPU workers, no NVML).
    """
    span = run.query("SELECT MIN(t_ms) AS a, MAX(t_ms) AS b FROM gpu_samples")
    if span["a"].isna().all():
        return pd.DataFrame(columns=["t_ms", "device", "samples", *GPU_METRICS])
    width = max((span["b"].max() - span["a"].min()) / max(1, max_points), 1e-9)
    means = ", ".join(f"AVG({m}) AS {m}" for m in GPU_METRICS)
    out = run.query(f"SELECT MIN(t_ms) AS t_ms, device, COUNT(*) AS samples, {means} FROM gpu_samples "
                    "GROUP BY device, CAST((t_ms - ?) / ? AS INTEGER) ORDER BY device, t_ms",
                    (float(span["a"].min()), float(width)))
    if "rank" in out:  # each rank samples its own GPUs
        out["device"] = out["device"] + " (rank " + out["rank"].astype(str) + ")"
        out = out.drop(columns="rank")
    order = {d: i for i, d in enumerate(run.meta.get("devices") or [])}
    out = out.sort_values(["device", "t_ms"], key=lambda s: s.map(lambda d: (order.get(d, len(order)), len(d), d))
                          if s.name == "device" else s, kind="stable").reset_index(drop=True)
    return out.astype({m: float for m in GPU_METRICS})


def timeline(run: StoredRun, first_step: int, last_step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phases and steps of steps first_step..last_step (at most TIMELINE_MAX_STEPS of them).

    Returns:
        (phases with step, call, phase, device, start_ms, duration_ms, end_ms;
         steps with step, start_ms, duration_ms, end_ms)
    """
    last_step = min(last_step, first_step + TIMELINE_MAX_STEPS - 1)
    phases = run.query("SELECT step, call, phase, device, start_ms, duration_ms FROM phases "
                       "WHERE step BETWEEN ? AND ? ORDER BY start_ms", (first_step, last_step))
    steps = run.query("SELECT step, start_ms, duration_ms FROM steps WHERE step BETWEEN ? AND ? ORDER BY step",
                      (first_step, last_step))
    if "rank" in steps:  # ranks step together: each step from the first rank's start to the last's end
        steps["end_ms"] = steps["start_ms"] + steps["duration_ms"]
        steps = steps.groupby("step", as_index=False).agg(start_ms=("start_ms", "min"), end_ms=("end_ms", "max"))
        steps["duration_ms"] = steps["end_ms"] - steps["start_ms"]
        phases = phases.drop(columns="rank").sort_values("start_ms", kind="stable").reset_index(drop=True)
    phases["end_ms"] = phases["start_ms"] + phases["duration_ms"]
    steps["end_ms"] = steps["start_ms"] + steps["duration_ms"]
    return phases, steps[["step", "start_ms", "duration_ms", "end_ms"]]


def last_steps_frames(run: StoredRun, last: int) -> dict[str, pd.DataFrame]:
    """The run's step-indexed tables restricted to its last ``last`` steps (and the GPU samples of that time).

    For findings on a large run that is still recording, when reading every table would be slow.
    """
    _, bounds = _span(run)
    lo = -1 if bounds is None else bounds - last + 1
    frames = {t: run.query(f"SELECT * FROM {t} WHERE step >= ?", (lo,))
              for t in ("steps", "phases", "memory", "allocator", "comms")}
    t0 = frames["steps"]["start_ms"].min() if not frames["steps"].empty else 0.0
    frames["gpu_samples"] = run.query("SELECT * FROM gpu_samples WHERE t_ms >= ?", (float(t0),))
    frames["steps"]["explicit"] = frames["steps"]["explicit"].astype(bool)
    return frames
