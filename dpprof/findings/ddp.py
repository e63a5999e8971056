"""Rules for a process's steps (DistributedDataParallel ranks, recorded or imported): the straggler rank, the
gradient all-reduce's share and overlap, bucket sizes, uneven inputs."""
from __future__ import annotations

import pandas as pd

from dpprof.findings.base import Tables, finding
from dpprof.findings.dataparallel import straggler_row, straggler_verdict
from dpprof.findings.floors import cost_text, worth_time

__all__ = ["COMM_SHARE_WARN", "FEW_BUCKETS", "MANY_BUCKETS", "SMALL_BUCKET_BYTES", "straggler_rank",
           "communication", "uneven_inputs", "union_ms"]

# All-reduce busy more than 20% of the step is worth acting on.
COMM_SHARE_WARN = 0.20
# One bucket means the all-reduce cannot start before backward ends; more than 30 buckets of
# under 1 MiB each pay per-call latency many times (torch's default bucket_cap_mb is 25).
FEW_BUCKETS = 1
MANY_BUCKETS = 30
SMALL_BUCKET_BYTES = 2**20


def straggler_rank(t: Tables) -> list[dict]:
    """The rank whose gradients are ready last, step after step, and the time the others wait for it at the
    all-reduce (straggler_verdict: the one verdict the Overview's headline reads too)."""
    v = straggler_verdict(t)
    if v is None or not v.reported:
        return []
    slow = v.slowest
    return [straggler_row(v, "straggler_rank", f"{slow} is the straggler: the others wait for it at every all-reduce",
                          f"median time to gradients ready ({v.work})",
                          f"Look at {slow}'s forward and backward (its device: slower or shared GPU, throttling) and its "
                          "data (input pipeline, its share of the data). DDP steps at the pace of the slowest rank.")]


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def communication(t: Tables) -> list[dict]:
    """All-reduce share of the step and how much of it overlaps backward compute; bucket-size advice."""
    comms, phases = t.comms, t.phases
    if comms.empty:
        return []
    compute_end = phases[phases["phase"] == "backward_compute"].assign(
        end_ms=lambda d: d["start_ms"] + d["duration_ms"]).set_index(["step", "device"])["end_ms"]
    busy, overlapped = [], []
    for (step, device), c in comms.groupby(["step", "device"]):
        spans = list(zip(c["launch_ms"], c["launch_ms"] + c["duration_ms"]))
        busy.append(union_ms(spans))
        end = compute_end.get((step, device))
        overlapped.append(union_ms([(a, min(b, end)) for a, b in spans if a < end]) if end is not None else 0.0)
    comm_ms = sum(busy) / len(busy)
    step_ms = float(t.steps["duration_ms"].mean())
    share = comm_ms / step_ms
    overlap = sum(overlapped) / sum(busy) if sum(busy) else 0.0
    exposed_ms = comm_ms * (1 - overlap)
    findings = []
    if share >= COMM_SHARE_WARN and worth_time(comm_ms, step_ms):
        findings.append(finding("communication_share", "warning", None,
                                f"gradient all-reduce is busy {share:.0%} of the step, {overlap:.0%} of it overlapped",
                                f"all-reduce busy {comm_ms:.2f} ms per step per rank of a {step_ms:.2f} ms step; "
                                f"{overlap:.0%} of it ran while backward was still computing; the rest "
                                f"{cost_text(exposed_ms, t.later_step_count + 1)}",
                                "Raise the per-rank batch (communication is per step, compute per sample), or compress "
                                "gradients with a communication hook (fp16/bf16 compress, PowerSGD).", share))
    later = comms[comms["step"] > comms["step"].min()] if comms["step"].nunique() > 1 else comms  # DDP rebuilds buckets after step 0
    per_step_buckets = later.groupby(["step", "device"])["bucket"].nunique().median()
    mean_bytes = later["bucket_bytes"].mean()
    if per_step_buckets <= FEW_BUCKETS and share >= COMM_SHARE_WARN / 2 and worth_time(exposed_ms, step_ms):
        findings.append(finding("bucket_size", "info", None, "all gradients travel in one bucket",
                                f"{per_step_buckets:.0f} bucket per step of {mean_bytes / 2**20:.2f} MiB; "
                                f"{overlap:.0%} overlap; the all-reduce after backward "
                                f"{cost_text(exposed_ms, t.later_step_count + 1)}",
                                "With one bucket the all-reduce starts only when backward has finished: lower "
                                "bucket_cap_mb (DDP's default is 25) to below "
                                f"{max(mean_bytes / 2**20 / 4, 0.01):.2f} so it overlaps.", per_step_buckets))
    elif per_step_buckets > MANY_BUCKETS and mean_bytes < SMALL_BUCKET_BYTES and worth_time(comm_ms, step_ms):
        findings.append(finding("bucket_size", "info", None, f"{per_step_buckets:.0f} small buckets per step",
                                f"{per_step_buckets:.0f} buckets of {mean_bytes / 2**10:.0f} KiB on average; the "
                                f"all-reduce is busy {comm_ms:.2f} ms a step",
                                "Each all-reduce pays a fixed latency: raise bucket_cap_mb.", per_step_buckets))
    return findings


def uneven_inputs(t: Tables) -> list[dict]:
    """Ranks fed different batch sizes in the same step."""
    steps = t.steps
    if t.steps["rank"].nunique() < 2 or steps["batch_size"].isna().all():
        return []
    spread = steps.groupby("step")["batch_size"].agg(["min", "max"])
    uneven = spread[spread["min"] != spread["max"]]
    if uneven.empty:
        return []
    first = uneven.index[0]
    sizes = steps[steps["step"] == first].sort_values("rank")["batch_size"].map(
        lambda b: None if pd.isna(b) else int(b)).tolist()
    return [finding("uneven_inputs", "warning", None, f"ranks got different batch sizes in {len(uneven)} steps",
                    f"e.g. step {first}: batch sizes by rank {sizes}; DDP weighs each rank's gradients equally, so "
                    "those steps train on a skewed average",
                    "DDP averages gradients as if every rank's batch were equal; use DistributedSampler with "
                    "drop_last=True, or the join() context manager for uneven inputs.", len(uneven) / len(spread))]
