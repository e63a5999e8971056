"""Rules for DataParallel's steps (recorded, balanced, or a trace of dpprof.DataParallel): the straggler, the
output device's memory, the DataParallel tax, uneven and idle chunks, backward's share."""
from __future__ import annotations

import pandas as pd

from dpprof.findings.base import Tables, finding, per_step
from dpprof.findings.floors import (CRITICAL_STEP_SHARE, cost_text, imbalance, mib, worth_bytes, worth_time)
from dpprof.records import DP_TAX_PHASES, MEMORY_BYTES

__all__ = ["STRAGGLER_RATIO", "STRAGGLER_RATIO_CPU", "STRAGGLER_CONSISTENCY", "STRAGGLER_CRITICAL_RATIO",
           "MEMORY_SKEW_RATIO", "MEMORY_SKEW_CRITICAL_RATIO", "DP_TAX_WARN", "UNEVEN_STEPS_SHARE",
           "BACKWARD_SHARE_INFO", "straggler_threshold", "straggler", "memory_skew", "dataparallel_tax",
           "uneven_chunks", "backward_share"]

# A device is a straggler when its median apply time is 15% above the others' (smaller gaps are
# within run-to-run noise on shared machines) ...
STRAGGLER_RATIO = 1.15
# ... or 30% on CPU workers: they share cores and torch's intra-op thread pool, and balanced
# 2-worker runs on a 2-core machine measured up to 17% apart.
STRAGGLER_RATIO_CPU = 1.30
# ... and it is the slowest device in at least 60% of steps (consistently, not one bad step).
STRAGGLER_CONSISTENCY = 0.6
# Critical from 1.5x: the other devices then sit idle for a third of the slowest one's apply, every step.
STRAGGLER_CRITICAL_RATIO = 1.5
# The output device holds 25% more than the average other device: beyond allocator rounding and
# the loss's own tensors, that is gathered outputs, the skew DataParallel is known for.
MEMORY_SKEW_RATIO = 1.25
# Critical from 2x: the output device alone then sets the largest batch that fits, at half what the others
# could take.
MEMORY_SKEW_CRITICAL_RATIO = 2.0
# Scatter + replicate + gather above 10% of the step: the DataParallel-only work DDP does not do
# (critical from CRITICAL_STEP_SHARE of the step).
DP_TAX_WARN = 0.10
# Uneven chunks in more than 10% of steps (one short last batch per epoch is normal and ignored).
UNEVEN_STEPS_SHARE = 0.10
# Backward over half the step: reported so the gradient reduction onto device_ids[0] is seen.
BACKWARD_SHARE_INFO = 0.5


def straggler_threshold(t: Tables) -> float:
    """STRAGGLER_RATIO_CPU where devices share the host's cores (CPU workers, ranks on CPUs), else STRAGGLER_RATIO."""
    on_gpus = t.model.backend == "cuda" or bool({"allocator", "gpu_samples", "gpu_time"} & t.model.has)
    return STRAGGLER_RATIO if on_gpus else STRAGGLER_RATIO_CPU


def straggler(t: Tables) -> list[dict]:
    found = imbalance(per_step(t, ["apply"]))
    if found is None or found.ratio < straggler_threshold(t) or found.slowest_share < STRAGGLER_CONSISTENCY:
        return []
    wait, step_ms = found.wait_ms_per_step, t.median_step_ms
    if not worth_time(wait, step_ms):
        return []
    slow = found.slowest
    return [finding("straggler", "critical" if found.ratio >= STRAGGLER_CRITICAL_RATIO else "warning", slow,
                    f"{slow} is the straggler: its apply takes {found.ratio:.2f}x the others'",
                    f"median apply {found.medians[slow]:.2f} ms on {slow} vs {found.medians.drop(slow).median():.2f} ms "
                    f"on the others; slowest in {found.slowest_share:.0%} of {found.steps} steps; the others wait "
                    f"{wait:.2f} ms per step, {wait * t.later_step_count / 1e3:.2f} s over the run "
                    f"({wait / step_ms:.0%} of the median step)",
                    f"Every step waits for {slow}. If its chunk is bigger or its inputs longer (sorted or bucketed "
                    f"batches), shuffle within the batch or balance by cost; if it is a slower or busier device, "
                    f"leave it out of device_ids.", found.ratio)]


def _held(memory: pd.DataFrame) -> pd.DataFrame:
    per = memory.groupby(["device", "step"])[list(MEMORY_BYTES)].sum()
    per["held_bytes"] = per.sum(axis=1)
    return per


def memory_skew(t: Tables) -> list[dict]:
    memory, allocator = t.memory, t.allocator
    if memory.empty or memory["device"].nunique() < 2:
        return []
    per = _held(memory)
    peak = per["held_bytes"].groupby("device").max()
    gathered_by_device = per["gathered_bytes"].groupby("device").max()
    out = gathered_by_device.idxmax() if gathered_by_device.max() > 0 else peak.idxmax()
    others = peak.drop(out)
    source = "accounted"
    if not allocator.empty and allocator["device"].nunique() > 1:  # on CUDA the allocator knows better
        alloc_peak = allocator.groupby("device")["peak_allocated_bytes"].max()
        if out in alloc_peak.index:
            peak, others, source = alloc_peak, alloc_peak.drop(out), "allocator peak"
    excess = float(peak[out] - others.mean())
    ratio = peak[out] / others.mean() if others.mean() else 1.0
    if ratio < MEMORY_SKEW_RATIO or not worth_bytes(excess):
        return []
    gathered = gathered_by_device.get(out, 0)
    role = "the output device " if gathered else ""
    return [finding("memory_skew", "critical" if ratio >= MEMORY_SKEW_CRITICAL_RATIO else "warning", out,
                    f"{role}{out} holds {ratio:.2f}x the memory of the others",
                    f"{source} bytes: {out} {mib(peak[out])}, others {mib(others.mean())} on average: {mib(excess)} "
                    f"more on {out}; gathered outputs on {out}: {mib(gathered)} per step (the loss is computed there "
                    f"too)",
                    f"Compute the loss on every device instead of gathering: dpprof.DataParallelModel with "
                    f"dpprof.DataParallelCriterion keeps each device's outputs where they are, saving about "
                    f"{mib(gathered)} of gathered outputs on {out} (dpprof profile ... --balanced to measure)."
                    if gathered else
                    f"{out} holds more than the others without gathered outputs: look at what only it keeps (its "
                    "chunk, buffers or tensors the model puts on device_ids[0]).", ratio)]


def dataparallel_tax(t: Tables) -> list[dict]:
    steps = t.later_steps
    if t.phases.empty or steps.empty:
        return []
    tax = t.phases[t.phases["phase"].isin(DP_TAX_PHASES) & t.phases["step"].isin(steps.index)]
    by_phase = tax.groupby("phase")["duration_ms"].sum() / len(steps)
    tax_ms, step_ms = float(by_phase.sum()), float(steps.mean())
    share = tax_ms / step_ms if step_ms else 0.0
    if share < DP_TAX_WARN or not worth_time(tax_ms, step_ms):
        return []
    parts = ", ".join(f"{p} {by_phase.get(p, 0):.2f} ms" for p in DP_TAX_PHASES)
    return [finding("dataparallel_tax", "critical" if share >= CRITICAL_STEP_SHARE else "warning", None,
                    f"scatter, replicate and gather take {share:.0%} of the step",
                    f"per step: {parts} of a {step_ms:.2f} ms step; it {cost_text(tax_ms, t.later_step_count)}",
                    "This is work only DataParallel does: DistributedDataParallel runs one process per GPU with the "
                    "model resident there, so it has no replicate and no gather, and overlaps the gradient all-reduce "
                    "with backward. A larger batch per step also spreads this cost.", share)]


def uneven_chunks(t: Tables) -> list[dict]:
    """Steps whose chunks differ in size, and devices that never got one. Only the forward calls that
    scattered a batch count (a whole-batch loss call has no chunk)."""
    chunked = t.memory.dropna(subset=["chunk_size"])
    if chunked.empty:
        return []
    findings = []
    calls = chunked.groupby(["step", "call"])["chunk_size"].agg(["min", "max"])
    per_step = calls.groupby("step").agg(min=("min", "min"), max=("max", "max"))
    uneven = per_step[per_step["min"] != per_step["max"]]
    share = len(uneven) / len(per_step)
    if share > UNEVEN_STEPS_SHARE:
        step = uneven.index[0]
        first_call = chunked[chunked["step"] == step]["call"].min()
        sizes = [int(c) for c in chunked[(chunked["step"] == step) & (chunked["call"] == first_call)]
                 .sort_values("device", key=lambda s: s.map({d: i for i, d in enumerate(t.model.devices)}))["chunk_size"]]
        spread = (uneven["max"] - uneven["min"]) / uneven["max"]
        findings.append(finding("uneven_chunks", "warning", None, f"chunks were uneven in {share:.0%} of steps",
                                f"{len(uneven)} of {len(per_step)} steps; e.g. step {step}: chunks {sizes}; the "
                                f"largest chunk is {spread.mean():.0%} bigger than the smallest on average, work the "
                                "other devices wait for",
                                f"torch.chunk splits the batch; use a batch size that {len(t.model.devices)} divides "
                                "evenly (dpprof check --batch-size N shows the split).", share))
    idle = list(t.model.idle)
    if idle:
        n = len(t.model.devices)
        findings.append(finding("idle_devices", "critical", idle[0], f"{len(idle)} device(s) never got a chunk",
                                f"devices {', '.join(idle)} of {n} did no work in any step: the run used "
                                f"{n - len(idle)} of its {n} devices",
                                "The batch is smaller than the number of devices times the chunk torch.chunk makes; "
                                "raise the batch size or use fewer devices.", len(idle)))
    return findings


def backward_share(t: Tables) -> list[dict]:
    steps = t.later_steps
    backward = t.phases[(t.phases["phase"] == "backward") & t.phases["step"].isin(steps.index)]
    if backward.empty or steps.empty:
        return []
    backward_ms = float(backward["duration_ms"].sum() / len(steps))
    share = backward_ms / float(steps.mean())
    if share < BACKWARD_SHARE_INFO or not worth_time(backward_ms, float(steps.mean())):
        return []
    device = backward["device"].iloc[0]
    return [finding("backward_share", "info", device, f"backward takes {share:.0%} of the step",
                    f"mean backward {backward_ms:.2f} ms of a {steps.mean():.2f} ms step; it includes summing every "
                    f"replica's gradients onto {device}",
                    "Expected for small models; the reduction onto one device grows with devices and model size, "
                    "which DistributedDataParallel spreads across devices and overlaps with backward.", share)]
