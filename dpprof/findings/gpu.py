"""Rules for the GPUs themselves: from NVML samples (under-used and throttled GPUs) and from an imported trace's
GPU activity (idle GPUs, communication kernels and their overlap, the allocator's skew, DataParallel on GPUs)."""
from __future__ import annotations

from dpprof.findings.base import Tables, finding
from dpprof.findings.dataparallel import MEMORY_SKEW_CRITICAL_RATIO, MEMORY_SKEW_RATIO
from dpprof.findings.ddp import COMM_SHARE_WARN
from dpprof.findings.detail import NO_LOADER_WORDS, no_data_loader
from dpprof.findings.floors import cost_text, mib, worth_bytes, worth_time
from dpprof.records import SLOWDOWN_REASONS
from dpprof.units import plural

__all__ = ["UNDERUSED_UTIL_RATIO", "UNDERUSED_BUSY_PCT", "THROTTLED_SAMPLES_SHARE", "GPU_IDLE_WARN",
           "GPU_IDLE_CRITICAL", "gpu_underused", "throttling", "gpu_idle", "gpu_communication", "allocator_skew",
           "use_ddp"]

# A GPU busy less than half as much as the busiest one, while that one is over 50% busy.
UNDERUSED_UTIL_RATIO = 0.5
UNDERUSED_BUSY_PCT = 50.0
# Clocks throttled for a slowdown reason in more than 5% of samples.
THROTTLED_SAMPLES_SHARE = 0.05
# A GPU idle for more than a quarter of the step is waiting on the host (data loading, Python,
# synchronisation) or on another GPU: HTA's idle-time breakdown flags the same ...
GPU_IDLE_WARN = 0.25
# ... and critical from half the step: the GPU then does its work in less time than it waits.
GPU_IDLE_CRITICAL = 0.5


def gpu_underused(t: Tables) -> list[dict]:
    util = t.gpu_samples.dropna(subset=["gpu_util_pct"]).groupby("device")["gpu_util_pct"].mean()
    if len(util) < 2 or util.max() < UNDERUSED_BUSY_PCT:
        return []
    busiest = util.idxmax()
    return [finding("gpu_underused", "warning", d, f"{d} was busy {u:.0f}% of the time, {busiest} {util.max():.0f}%",
                    f"mean NVML GPU utilisation: {d} {u:.0f}%, {busiest} {util.max():.0f}%: {d} did "
                    f"{1 - u / util.max():.0%} less work per second than it could have",
                    f"{d} waits for the others; see the straggler and memory findings, or give it a bigger share.",
                    u / util.max(), "ratio")
            for d, u in util.items() if d != busiest and u < UNDERUSED_UTIL_RATIO * util.max()]


def throttling(t: Tables) -> list[dict]:
    samples = t.gpu_samples.dropna(subset=["throttle_reasons"])
    findings = []
    for device, s in samples.groupby("device"):
        slow = s["throttle_reasons"].map(lambda r: [x for x in r.split(",") if x in SLOWDOWN_REASONS])
        share = (slow.str.len() > 0).mean()
        if share > THROTTLED_SAMPLES_SHARE:
            reasons = sorted({x for r in slow for x in r})
            findings.append(finding("throttling", "warning", device, f"{device} was throttled in {share:.0%} of samples",
                                    f"reasons: {', '.join(reasons)}; {len(s)} samples: its clocks were lowered "
                                    f"{share:.0%} of the time",
                                    "A throttled GPU slows every step: check cooling, power limits and other jobs.",
                                    share, "share"))
    return findings


def gpu_idle(t: Tables) -> list[dict]:
    gpu_time = t.gpu_time
    if gpu_time.empty:
        return []
    per = gpu_time.groupby("device")[["idle_ms", "window_ms"]].sum()
    per = per[per["window_ms"] > 0]
    out = []
    for device, row in per.iterrows():
        share = row["idle_ms"] / row["window_ms"]
        steps = int((gpu_time["device"] == device).sum())
        idle_ms, window_ms = row["idle_ms"] / steps, row["window_ms"] / steps
        if share > GPU_IDLE_WARN and worth_time(idle_ms, window_ms):
            out.append(finding("gpu_idle", "critical" if share >= GPU_IDLE_CRITICAL else "warning", device,
                               f"{device}'s GPU is idle {share:.0%} of the step",
                               f"no kernel, copy or memset ran for {idle_ms:.2f} ms of a {window_ms:.2f} ms step on "
                               f"average ({plural(steps, 'step')}): idle time {cost_text(idle_ms, steps)}",
                               "The GPU waits on the host: look at "
                               + (NO_LOADER_WORDS if no_data_loader(t, str(device)) else
                                  "data loading (more DataLoader workers, pinned memory)")
                               + ", host-side Python between kernels, and synchronising calls (.item(), .cpu()).",
                               share, "share"))
    return out


def gpu_communication(t: Tables) -> list[dict]:
    gpu_time = t.gpu_time
    if gpu_time.empty or not (gpu_time["communication_ms"] > 0).any():
        return []
    per = gpu_time.groupby("device")[["communication_ms", "overlap_ms", "window_ms"]].sum()
    comm, overlap, window = per["communication_ms"].sum(), per["overlap_ms"].sum(), per["window_ms"].sum()
    share = comm / window if window else 0.0
    overlapped = overlap / comm if comm else 0.0
    steps = int(gpu_time["step"].nunique())
    exposed_ms = (comm - overlap) / len(per) / steps
    if share < COMM_SHARE_WARN or not worth_time(comm / len(per) / steps, window / len(per) / steps):
        return []
    names = sorted(set(t.comms["collective"].dropna())) if "collective" in t.comms else []
    what = f"collective kernels ({', '.join(names)})" if names else "communication kernels"
    return [finding("gpu_communication", "warning", None,
                    f"{what} run {share:.0%} of the step, {overlapped:.0%} of it overlapped with compute",
                    "per device: " + "; ".join(f"{d} {r['communication_ms'] / r['window_ms']:.0%} communication, "
                                               f"{r['overlap_ms'] / r['communication_ms'] if r['communication_ms'] else 0:.0%} "
                                               "overlapped" for d, r in per.iterrows())
                    + f"; communication outside compute {cost_text(exposed_ms, steps)}",
                    "Raise the per-rank batch (communication is per step, compute per sample), let DDP overlap more "
                    "(smaller bucket_cap_mb so all-reduces start earlier in backward), or compress gradients with a "
                    "communication hook.", share, "share")]


def allocator_skew(t: Tables) -> list[dict]:
    allocator = t.allocator
    if allocator.empty or allocator["device"].nunique() < 2:
        return []
    peak = allocator.groupby("device")["peak_allocated_bytes"].max()
    first = "cuda:0" if "cuda:0" in peak.index else peak.index[0]
    others = peak.drop(first)
    ratio = peak[first] / others.mean() if others.mean() else 1.0
    excess = float(peak[first] - others.mean())
    if ratio < MEMORY_SKEW_RATIO or not worth_bytes(excess):
        return []
    return [finding("memory_skew", "critical" if ratio >= MEMORY_SKEW_CRITICAL_RATIO else "warning", first,
                    f"{first} peaks at {ratio:.2f}x the memory of the other GPUs",
                    f"allocator peak from the trace's [memory] events: {first} {mib(peak[first])}, the others "
                    f"{mib(others.mean())} on average: {mib(excess)} more on {first}",
                    "DataParallel gathers every output and computes the loss on the first device: compute the loss on "
                    "every device (dpprof.DataParallelModel with dpprof.DataParallelCriterion) or move to "
                    "DistributedDataParallel.", ratio, "ratio")]


def use_ddp(t: Tables) -> list[dict]:
    """An imported trace of torch's DataParallel driving several GPUs from one process."""
    gpus = [d for d in t.model.devices if d.startswith("cuda")]
    if t.traced_dataparallel is None or len(gpus) < 2:
        return []
    return [finding("use_ddp", "info", None, f"DataParallel on {len(gpus)} GPUs",
                    f"the trace shows DataParallel.forward driving {', '.join(gpus)} from one process",
                    "One process drives every GPU under the GIL, replicates the model every step and gathers outputs "
                    "on one GPU: DistributedDataParallel (one process per GPU) is PyTorch's recommendation and is "
                    "usually faster; dpprof.DistributedDataParallel records it the same way.", float(len(gpus)),
                    "count")]
