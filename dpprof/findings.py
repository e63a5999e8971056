"""Findings from a recorded run: pure functions, run DataFrames in, a findings DataFrame out.

Each finding names a device where one is to blame, gives its evidence in numbers and says
what to do. Thresholds are named constants with the reason for their value.
"""
from __future__ import annotations

from dataclasses import fields

import pandas as pd

from dpprof.records import SLOWDOWN_REASONS
from dpprof.records import FindingRecord

__all__ = ["run_findings", "findings_withheld", "FINDING_COLUMNS", "FINDINGS_MIN_STEPS", "OUTLIER_STEP_RATIO",
           "OUTLIER_TIME_SHARE", "STRAGGLER_RATIO", "STRAGGLER_RATIO_CPU", "STRAGGLER_CONSISTENCY", "MEMORY_SKEW_RATIO",
           "DP_TAX_WARN", "UNEVEN_STEPS_SHARE", "UNDERUSED_UTIL_RATIO", "THROTTLED_SAMPLES_SHARE",
           "BACKWARD_SHARE_INFO", "COMM_SHARE_WARN", "FEW_BUCKETS", "MANY_BUCKETS", "SMALL_BUCKET_BYTES"]

FINDING_COLUMNS = [f.name for f in fields(FindingRecord)]

# A device is a straggler when its median apply time is 15% above the others' (smaller gaps are
# within run-to-run noise on shared machines) ...
STRAGGLER_RATIO = 1.15
# ... or 30% on CPU workers: they share cores and torch's intra-op thread pool, and balanced
# 2-worker runs on a 2-core machine measured up to 17% apart.
STRAGGLER_RATIO_CPU = 1.30
# ... and it is the slowest device in at least 60% of steps (consistently, not one bad step).
STRAGGLER_CONSISTENCY = 0.6
# The output device holds 25% more than the average other device: beyond allocator rounding and
# the loss's own tensors, that is gathered outputs, the skew DataParallel is known for.
MEMORY_SKEW_RATIO = 1.25
# Scatter + replicate + gather above 10% of the step: the DataParallel-only work DDP does not do.
DP_TAX_WARN = 0.10
# Uneven chunks in more than 10% of steps (one short last batch per epoch is normal and ignored).
UNEVEN_STEPS_SHARE = 0.10
# A GPU busy less than half as much as the busiest one, while that one is over 50% busy.
UNDERUSED_UTIL_RATIO = 0.5
UNDERUSED_BUSY_PCT = 50.0
# Clocks throttled for a slowdown reason in more than 5% of samples.
THROTTLED_SAMPLES_SHARE = 0.05
# Backward over half the step: reported so the gradient reduction onto device_ids[0] is seen.
BACKWARD_SHARE_INFO = 0.5

# DistributedDataParallel: all-reduce busy more than 20% of the step is worth acting on.
COMM_SHARE_WARN = 0.20
# One bucket means the all-reduce cannot start before backward ends; more than 30 buckets of
# under 1 MiB each pay per-call latency many times (torch's default bucket_cap_mb is 25).
FEW_BUCKETS = 1
MANY_BUCKETS = 30
SMALL_BUCKET_BYTES = 2**20

# No findings from fewer steps than this: the first step carries one-time costs (threads started,
# memory allocated, lazy initialisation), and the straggler rule needs three steps to call a device
# consistently slow. A run that failed after one step says nothing about balance.
FINDINGS_MIN_STEPS = 3
# A step (past the first) over 2x the run's median step is an outlier: a stall or contention from
# outside the step (another process on the same cores or GPU, data loading, swapping), not the
# model's own variation, which stays well within 2x on a steady machine ...
OUTLIER_STEP_RATIO = 2.0
# ... worth a finding when the outliers' time beyond the median is over 5% of the run's step time.
OUTLIER_TIME_SHARE = 0.05
# Outlier steps listed in the evidence (the slowest first).
OUTLIER_STEPS_LISTED = 8

_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def _f(kind: str, severity: str, device: str | None, title: str, evidence: str, advice: str,
       value: float | None) -> dict:
    return dict(kind=kind, severity=severity, device=device, title=title, evidence=evidence, advice=advice,
                value=None if value is None else float(value))


def _per_step(phases: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Milliseconds of the named phases per step (rows) and device (columns), forward calls summed."""
    sel = phases[phases["phase"].isin(names)]
    return sel.groupby(["step", "device"])["duration_ms"].sum().unstack("device")


def _slowest(table: pd.DataFrame, threshold: float) -> tuple[str, pd.Series, float, float] | None:
    """The device whose median per step (``table``: steps x devices) is highest, when it is at least
    ``threshold`` times the others' and it is the slowest in STRAGGLER_CONSISTENCY of the steps:
    (device, medians, ratio, share of steps it was slowest in), else None."""
    if table.shape[1] < 2 or len(table) < 3:
        return None
    medians = table.median()
    slow = medians.idxmax()
    ratio = medians[slow] / medians.drop(slow).median()
    slowest_share = (table.idxmax(axis=1) == slow).mean()
    if ratio < threshold or slowest_share < STRAGGLER_CONSISTENCY:
        return None
    return slow, medians, ratio, slowest_share


def straggler(phases: pd.DataFrame) -> list[dict]:
    table = _per_step(phases, ["apply"]).dropna()
    cpu = table.shape[1] > 0 and str(table.columns[0]).startswith("cpu")
    found = _slowest(table, STRAGGLER_RATIO_CPU if cpu else STRAGGLER_RATIO)
    if found is None:
        return []
    slow, medians, ratio, slowest_share = found
    others = medians.drop(slow)
    wait = table.drop(columns=slow).rsub(table[slow], axis=0).clip(lower=0).mean(axis=1)  # per other device
    return [_f("straggler", "critical" if ratio >= 1.5 else "warning", slow,
               f"{slow} is the straggler: its apply takes {ratio:.2f}x the others'",
               f"median apply {medians[slow]:.2f} ms on {slow} vs {others.median():.2f} ms on the others; slowest in "
               f"{slowest_share:.0%} of {len(table)} steps; the others wait {wait.mean():.2f} ms per step, "
               f"{wait.sum() / 1e3:.2f} s over the run",
               f"Every step waits for {slow}. If its chunk is bigger or its inputs longer (sorted or bucketed "
               f"batches), shuffle within the batch or balance by cost; if it is a slower or busier device, "
               f"leave it out of device_ids.", ratio)]


def _held(memory: pd.DataFrame) -> pd.DataFrame:
    cols = ["input_bytes", "output_bytes", "activation_bytes", "gathered_bytes", "param_bytes", "buffer_bytes"]
    per = memory.groupby(["device", "step"])[cols].sum()
    per["held_bytes"] = per.sum(axis=1)
    return per


def memory_skew(memory: pd.DataFrame, allocator: pd.DataFrame, output_device: str | None) -> list[dict]:
    if memory.empty or memory["device"].nunique() < 2:
        return []
    per = _held(memory)
    peak = per["held_bytes"].groupby("device").max()
    out = output_device if output_device in peak.index else per["gathered_bytes"].groupby("device").max().idxmax()
    others = peak.drop(out)
    source = "accounted"
    if not allocator.empty and allocator["device"].nunique() > 1:  # on CUDA the allocator knows better
        peak = allocator.groupby("device")["peak_allocated_bytes"].max()
        if out in peak.index:
            others = peak.drop(out)
            source = "allocator peak"
    ratio = peak[out] / others.mean() if others.mean() else 1.0
    if ratio < MEMORY_SKEW_RATIO:
        return []
    gathered = per["gathered_bytes"].groupby("device").max().get(out, 0)
    return [_f("memory_skew", "warning" if ratio < 2 else "critical", out,
               f"the output device {out} holds {ratio:.2f}x the memory of the others",
               f"{source} bytes: {out} {peak[out] / 2**20:.1f} MiB, others {others.mean() / 2**20:.1f} MiB on "
               f"average; gathered outputs on {out}: {gathered / 2**20:.1f} MiB per step (the loss is computed there "
               f"too)",
               f"Compute the loss on every device instead of gathering: dpprof.DataParallelModel with "
               f"dpprof.DataParallelCriterion keeps each device's outputs where they are, saving about "
               f"{gathered / 2**20:.1f} MiB of gathered outputs on {out} (dpprof profile ... --balanced to measure).",
               ratio)]


def dataparallel_tax(phases: pd.DataFrame, steps: pd.DataFrame) -> list[dict]:
    if phases.empty or steps.empty:
        return []
    tax = phases[phases["phase"].isin(["scatter", "replicate", "gather"])]
    by_phase = tax.groupby("phase")["duration_ms"].sum() / len(steps)
    share = by_phase.sum() / steps["duration_ms"].mean()
    if share < DP_TAX_WARN:
        return []
    parts = ", ".join(f"{p} {by_phase.get(p, 0):.2f} ms" for p in ("scatter", "replicate", "gather"))
    return [_f("dataparallel_tax", "warning" if share < 0.25 else "critical", None,
               f"scatter, replicate and gather take {share:.0%} of the step",
               f"per step: {parts} of a {steps['duration_ms'].mean():.2f} ms step",
               "This is work only DataParallel does: DistributedDataParallel runs one process per GPU with the "
               "model resident there, so it has no replicate and no gather, and overlaps the gradient all-reduce "
               "with backward. A larger batch per step also spreads this cost.", share)]


def uneven_chunks(memory: pd.DataFrame, devices: list[str]) -> list[dict]:
    if memory.empty:
        return []
    per_step = memory.groupby("step")["chunk_size"].agg(["min", "max", "count"])
    uneven = per_step[(per_step["min"] != per_step["max"]) | (per_step["count"] < len(devices))]
    findings = []
    share = len(uneven) / len(per_step)
    if share > UNEVEN_STEPS_SHARE:
        sizes = [("none" if pd.isna(c) else int(c)) for c in
                 memory[memory["step"] == uneven.index[0]].sort_values("device")["chunk_size"]]
        findings.append(_f("uneven_chunks", "warning", None,
                           f"chunks were uneven in {share:.0%} of steps",
                           f"{len(uneven)} of {len(per_step)} steps; e.g. step {uneven.index[0]}: chunks {sizes}",
                           f"torch.chunk splits the batch; use a batch size that {len(devices)} divides evenly "
                           "(dpprof check --batch-size N shows the split).", share))
    idle = [d for d in devices if d not in set(memory["device"])]
    if idle:
        findings.append(_f("idle_devices", "critical", idle[0], f"{len(idle)} device(s) never got a chunk",
                           f"devices {', '.join(idle)} of {len(devices)} did no work in any step",
                           "The batch is smaller than the number of devices times the chunk torch.chunk makes; "
                           "raise the batch size or use fewer devices.", len(idle)))
    return findings


def gpu_underused(gpu_samples: pd.DataFrame) -> list[dict]:
    util = gpu_samples.dropna(subset=["gpu_util_pct"]).groupby("device")["gpu_util_pct"].mean()
    if len(util) < 2 or util.max() < UNDERUSED_BUSY_PCT:
        return []
    busiest = util.idxmax()
    return [_f("gpu_underused", "warning", d, f"{d} was busy {u:.0f}% of the time, {busiest} {util.max():.0f}%",
               f"mean NVML GPU utilisation: {d} {u:.0f}%, {busiest} {util.max():.0f}%",
               f"{d} waits for the others; see the straggler and memory findings, or give it a bigger share.",
               u / util.max())
            for d, u in util.items() if d != busiest and u < UNDERUSED_UTIL_RATIO * util.max()]


def throttling(gpu_samples: pd.DataFrame) -> list[dict]:
    samples = gpu_samples.dropna(subset=["throttle_reasons"])
    findings = []
    for device, s in samples.groupby("device"):
        slow = s["throttle_reasons"].map(lambda r: [x for x in r.split(",") if x in SLOWDOWN_REASONS])
        share = (slow.str.len() > 0).mean()
        if share > THROTTLED_SAMPLES_SHARE:
            reasons = sorted({x for r in slow for x in r})
            findings.append(_f("throttling", "warning", device, f"{device} was throttled in {share:.0%} of samples",
                               f"reasons: {', '.join(reasons)}; {len(s)} samples",
                               "A throttled GPU slows every step: check cooling, power limits and other jobs.", share))
    return findings


def backward_share(phases: pd.DataFrame, steps: pd.DataFrame) -> list[dict]:
    backward = phases[phases["phase"] == "backward"]
    if backward.empty or steps.empty:
        return []
    share = backward["duration_ms"].sum() / steps["duration_ms"].sum()
    if share < BACKWARD_SHARE_INFO:
        return []
    return [_f("backward_share", "info", backward["device"].iloc[0], f"backward takes {share:.0%} of the step",
               f"mean backward {backward['duration_ms'].sum() / len(steps):.2f} ms of a "
               f"{steps['duration_ms'].mean():.2f} ms step; it includes summing every replica's gradients "
               f"onto {backward['device'].iloc[0]}",
               "Expected for small models; the reduction onto one device grows with devices and model size, "
               "which DistributedDataParallel spreads across devices and overlaps with backward.", share)]


def _step_durations(steps: pd.DataFrame) -> pd.Series:
    """Milliseconds per step (a distributed run's ranks step together: the slowest rank's time)."""
    return steps.groupby("step")["duration_ms"].max().sort_index()


def outlier_steps(steps: pd.DataFrame) -> list[dict]:
    """Steps far beyond the run's median (stalls, contention from other load), named with their times."""
    per = _step_durations(steps).iloc[1:]  # the first step's one-time costs are no stall
    if len(per) < FINDINGS_MIN_STEPS:
        return []
    median = float(per.median())
    slow = per[per > OUTLIER_STEP_RATIO * median]
    excess = float((slow - median).sum())
    share = excess / float(per.sum()) if per.sum() else 0.0
    if slow.empty or share < OUTLIER_TIME_SHARE:
        return []
    worst = slow.sort_values(ascending=False)
    listed = ", ".join(f"{s} ({ms:.0f} ms)" for s, ms in worst.head(OUTLIER_STEPS_LISTED).items())
    more = f" and {len(worst) - OUTLIER_STEPS_LISTED} more" if len(worst) > OUTLIER_STEPS_LISTED else ""
    return [_f("outlier_steps", "warning" if share >= 4 * OUTLIER_TIME_SHARE else "info", None,
               f"{len(slow)} of {len(per)} steps took over {OUTLIER_STEP_RATIO:g}x the median step",
               f"median step {median:.2f} ms; steps {listed}{more}; {excess / 1e3:.2f} s beyond the median, "
               f"{share:.0%} of the run's step time (the first step is left out)",
               "Steps that stall like this come from outside the model: another process on the same cores or GPU "
               "(another run started alongside), data loading, swapping or garbage collection. Check what else "
               "ran at those steps; the per-device findings of such a run are less certain.", share)]


def findings_withheld(steps: pd.DataFrame) -> str | None:
    """Why a run's tables give no findings (too few steps), or None when findings can be computed."""
    count = int(steps["step"].nunique()) if not steps.empty else 0
    if count >= FINDINGS_MIN_STEPS:
        return None
    return (f"no findings from {count} step{'s' if count != 1 else ''}: they need at least {FINDINGS_MIN_STEPS} "
            "(the first step carries one-time costs, and a device is called slow only when it is slow step "
            "after step)")


def straggler_rank(phases: pd.DataFrame, threshold: float = STRAGGLER_RATIO) -> list[dict]:
    """The rank that reaches the all-reduce last, step after step, and the time the others wait for it."""
    busy = _per_step(phases, ["data", "forward", "backward_compute"]).dropna()
    found = _slowest(busy, threshold)
    if found is None:
        return []
    slow, medians, ratio, slowest_share = found
    wait = _per_step(phases, ["comm_wait"]).reindex(busy.index)
    others_wait = wait.drop(columns=slow).mean(axis=1)
    return [_f("straggler_rank", "critical" if ratio >= 1.5 else "warning", slow,
               f"{slow} is the straggler: the others wait for it at every all-reduce",
               f"median time to gradients ready (data + forward + backward compute): {slow} {medians[slow]:.2f} ms, "
               f"the others {medians.drop(slow).median():.2f} ms; slowest in {slowest_share:.0%} of {len(busy)} steps; "
               f"the other ranks wait {others_wait.mean():.2f} ms per step at the all-reduce, "
               f"{others_wait.sum() / 1e3:.2f} s over the run",
               f"Look at {slow}'s data phase (input pipeline, its share of the data) and its device (slower or "
               f"shared GPU, throttling). DDP steps at the pace of the slowest rank.", ratio)]


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def communication(phases: pd.DataFrame, comms: pd.DataFrame, steps: pd.DataFrame) -> list[dict]:
    """All-reduce share of the step and how much of it overlaps backward compute; bucket-size advice."""
    if comms.empty:
        return []
    compute_end = phases[phases["phase"] == "backward_compute"].assign(
        end_ms=lambda d: d["start_ms"] + d["duration_ms"]).set_index(["step", "device"])["end_ms"]
    busy, overlapped = [], []
    for (step, device), c in comms.groupby(["step", "device"]):
        spans = list(zip(c["launch_ms"], c["launch_ms"] + c["duration_ms"]))
        busy.append(_union_ms(spans))
        end = compute_end.get((step, device))
        overlapped.append(_union_ms([(a, min(b, end)) for a, b in spans if a < end]) if end is not None else 0.0)
    comm_ms = sum(busy) / len(busy)
    share = comm_ms / steps["duration_ms"].mean()
    overlap = sum(overlapped) / sum(busy) if sum(busy) else 0.0
    findings = []
    if share >= COMM_SHARE_WARN:
        findings.append(_f("communication_share", "warning", None,
                           f"gradient all-reduce is busy {share:.0%} of the step, {overlap:.0%} of it overlapped",
                           f"all-reduce busy {comm_ms:.2f} ms per step per rank of a {steps['duration_ms'].mean():.2f} ms "
                           f"step; {overlap:.0%} of it ran while backward was still computing",
                           "Raise the per-rank batch (communication is per step, compute per sample), or compress "
                           "gradients with a communication hook (fp16/bf16 compress, PowerSGD).", share))
    later = comms[comms["step"] > comms["step"].min()] if comms["step"].nunique() > 1 else comms  # DDP rebuilds buckets after step 0
    per_step = later.groupby(["step", "device"])["bucket"].nunique().median()
    mean_bytes = later["bucket_bytes"].mean()
    if per_step <= FEW_BUCKETS and share >= COMM_SHARE_WARN / 2:
        findings.append(_f("bucket_size", "info", None, "all gradients travel in one bucket",
                           f"{per_step:.0f} bucket per step of {mean_bytes / 2**20:.2f} MiB; {overlap:.0%} overlap",
                           "With one bucket the all-reduce starts only when backward has finished: lower bucket_cap_mb "
                           f"(DDP's default is 25) to below {max(mean_bytes / 2**20 / 4, 0.01):.2f} so it overlaps.",
                           per_step))
    elif per_step > MANY_BUCKETS and mean_bytes < SMALL_BUCKET_BYTES:
        findings.append(_f("bucket_size", "info", None, f"{per_step:.0f} small buckets per step",
                           f"{per_step:.0f} buckets of {mean_bytes / 2**10:.0f} KiB on average",
                           "Each all-reduce pays a fixed latency: raise bucket_cap_mb.", per_step))
    return findings


def uneven_inputs(steps: pd.DataFrame) -> list[dict]:
    """Ranks fed different batch sizes in the same step."""
    if "rank" not in steps.columns or steps["batch_size"].isna().all():
        return []
    spread = steps.groupby("step")["batch_size"].agg(["min", "max"])
    uneven = spread[spread["min"] != spread["max"]]
    if uneven.empty:
        return []
    first = uneven.index[0]
    sizes = steps[steps["step"] == first].sort_values("rank")["batch_size"].tolist()
    return [_f("uneven_inputs", "warning", None, f"ranks got different batch sizes in {len(uneven)} steps",
               f"e.g. step {first}: batch sizes by rank {sizes}",
               "DDP averages gradients as if every rank's batch were equal; use DistributedSampler with "
               "drop_last=True, or the join() context manager for uneven inputs.", len(uneven) / len(spread))]


def run_findings(steps: pd.DataFrame, phases: pd.DataFrame, memory: pd.DataFrame, allocator: pd.DataFrame,
                 gpu_samples: pd.DataFrame, devices: list[str], output_device: str | None = None,
                 comms: pd.DataFrame | None = None) -> pd.DataFrame:
    """All findings for one run, worst first.

    Args:
        steps, phases, memory, allocator, gpu_samples: the run's tables.
        devices: the run's device labels, in device_ids order.
        output_device: where outputs were gathered (default: the device holding the gathered bytes).
        comms: the all-reduce table of a DistributedDataParallel run (ranks as devices).

    Returns:
        a DataFrame with the FindingRecord columns; empty from fewer than FINDINGS_MIN_STEPS steps
        (findings_withheld says why).
    """
    if findings_withheld(steps) is not None:
        return pd.DataFrame(columns=FINDING_COLUMNS)
    if comms is not None and not comms.empty or (phases["phase"] == "comm_wait").any():
        comms = comms if comms is not None else pd.DataFrame(columns=["step", "device", "bucket", "bucket_bytes",
                                                                        "launch_ms", "duration_ms"])
        # ranks on CPUs (no GPU samples) share cores as CPU workers do
        threshold = STRAGGLER_RATIO_CPU if gpu_samples.empty else STRAGGLER_RATIO
        rows = (straggler_rank(phases, threshold) + communication(phases, comms, steps) + uneven_inputs(steps)
                + gpu_underused(gpu_samples) + throttling(gpu_samples) + outlier_steps(steps))
    else:
        rows = (straggler(phases) + memory_skew(memory, allocator, output_device) + dataparallel_tax(phases, steps)
                + uneven_chunks(memory, devices) + gpu_underused(gpu_samples) + throttling(gpu_samples)
                + backward_share(phases, steps) + outlier_steps(steps))
    df = pd.DataFrame(rows, columns=FINDING_COLUMNS)
    if df.empty:
        return df
    df["_rank"] = df["severity"].map(_SEVERITY_RANK)
    return df.sort_values(["_rank", "value"], ascending=[True, False]).drop(columns="_rank").reset_index(drop=True)
