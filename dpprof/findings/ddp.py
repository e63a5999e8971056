"""Rules for a process's steps (DistributedDataParallel ranks, recorded or imported): the straggler rank, the
gradient all-reduce's share and overlap, bucket sizes, uneven inputs."""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dpprof.findings.base import Tables, finding
from dpprof.findings.dataparallel import straggler_row, straggler_verdict
from dpprof.findings.floors import cost_text, worth_time
from dpprof.findings.detail import no_data_loader
from dpprof.stepmodel import partition
from dpprof.store.model import RunModel
from dpprof.store.queries import training_steps_of
from dpprof.units import mib

__all__ = ["COMM_SHARE_WARN", "COMPRESSING_HOOKS", "FEW_BUCKETS", "MANY_BUCKETS", "SMALL_BUCKET_BYTES", "straggler_rank",
           "communication", "uneven_inputs", "union_ms", "overlapped_ms", "collective_busy", "later_collectives", "bucket_counts"]

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
    c = v.collectives
    if c is not None:  # the collectives' verdict: the wait inside them is the evidence
        # a rank that iterated no DataLoader loads nothing: what it does before them is the script's own work
        own = ("its own work between its optimizer step and its next forward (logging, checkpoints, evaluation, "
               "building batches: it iterates no DataLoader)" if no_data_loader(t, slow) else "its data loading")
        return [finding("straggler_rank", v.severity, slow, f"{slow} is the straggler: the others wait for it inside their collectives",
                        c.evidence(collective_steps(t)),
                        f"Look at what {slow} does before its collectives: {own}, its forward and backward "
                        "(a slower or shared device, throttling), its share of the data. The job steps at its pace.",
                        v.wait_share, "share")]
    return [straggler_row(v, "straggler_rank", f"{slow} is the straggler: the others wait for it at every all-reduce",
                          f"median time to gradients ready ({v.work})",
                          f"Look at {slow}'s forward and backward (its device: slower or shared GPU, throttling) and its "
                          "data (input pipeline, its share of the data). DDP steps at the pace of the slowest rank.")]


def collective_steps(t: Tables) -> int:
    """How many of the run's steps past the first ran collectives, what a wait inside them is paid over: an evaluation
    step between training steps runs none. From the steps read (a thinned run's sample), in proportion."""
    steps, comms = t.steps["step"], t.comms["step"]
    later = steps[steps != t.first_step].nunique()
    ran = comms[comms != t.first_step].nunique()
    return round(t.later_step_count * min(ran, later) / later) if later else t.later_step_count


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def overlapped_ms(comms: pd.DataFrame, compute: pd.DataFrame) -> dict[tuple[Any, Any], float]:
    """Per (step, device): how long its collectives ran while backward was computing: the union of their spans within
    the union of the step's ``backward_compute`` spans (one per backward pass: gradient accumulation makes several),
    0 where the step has none.

    Args:
        comms: step, device, launch_ms, duration_ms; compute: the backward_compute phases' step, device, start_ms,
            duration_ms.
    """
    ends = compute["start_ms"] + compute["duration_ms"]
    busy: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
    for key, a, b in zip(zip(compute["step"], compute["device"]), compute["start_ms"], ends):
        busy.setdefault(key, []).append((a, b))
    out = {}
    for key, c in comms.groupby(["step", "device"]):
        spans = busy.get(key)
        if not spans:
            out[key] = 0.0
            continue
        sent = list(zip(c["launch_ms"], c["launch_ms"] + c["duration_ms"]))
        # |A within B| = |A| + |B| - |A or B|, each a union of intervals
        out[key] = max(0.0, union_ms(sent) + union_ms(spans) - union_ms(sent + spans))
    return out


def collective_busy(comms: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The time collectives were in flight in each step of each device, in ms: the union of their spans clipped
    to the step's window (several in flight count once; one still running when the next step starts counts in
    each step it reaches), split by collective with ``stepmodel.partition`` (an instant where two kinds run goes
    to the one with more time in the run), so the kinds' columns sum to ``busy_ms``.

    Args:
        comms: the comms table (step, device, launch_ms, duration_ms, collective, rank).
        steps: the steps table (step, start_ms, duration_ms, rank): each rank's windows.

    Returns:
        columns step, device, window_ms, busy_ms and one ``<collective>`` column (ms) per kind, most time first;
        a recorded DDP run's bucket all-reduces are records.ALL_REDUCE.
    """
    if comms.empty or steps.empty:
        return pd.DataFrame(columns=["step", "device", "window_ms", "busy_ms"])
    comms = comms.assign(rank=comms.get("rank", 0))
    steps = steps.assign(rank=steps.get("rank", 0)).sort_values(["rank", "start_ms"])
    kinds = comms.assign(ms=comms["duration_ms"]).groupby("collective")["ms"].sum().sort_values(
        ascending=False, kind="stable").index.tolist()
    windows: list[pd.DataFrame] = []
    intervals: list[pd.DataFrame] = []
    for (rank, device), c in comms.groupby(["rank", "device"], sort=False):
        s = steps[steps["rank"] == rank]
        lo = s["start_ms"].to_numpy(dtype=float)
        hi = lo + s["duration_ms"].to_numpy(dtype=float)
        base = sum(len(w) for w in windows)
        windows.append(pd.DataFrame({"key": base + np.arange(len(lo)), "step": s["step"].to_numpy(),
                                     "device": device, "lo": lo, "hi": hi}))
        start = c["launch_ms"].to_numpy(dtype=float)
        end = start + c["duration_ms"].to_numpy(dtype=float)
        first = np.searchsorted(np.maximum.accumulate(hi), start, "right")  # the first window ending after it starts
        count = np.maximum(np.searchsorted(lo, end, "left") - first, 0)  # the windows it reaches
        which = np.repeat(np.arange(len(start)), count)
        offset = np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
        intervals.append(pd.DataFrame({"key": base + np.repeat(first, count) + offset, "start": start[which],
                                       "end": end[which], "kind": c["collective"].to_numpy()[which]}))
    table = pd.concat(windows, ignore_index=True)
    parts = partition(table, pd.concat(intervals, ignore_index=True), [(k, (k,)) for k in kinds], ["key"])
    out = table[["step", "device"]].reset_index(drop=True).assign(window_ms=parts["window_ms"],
                                                                  busy_ms=parts[kinds].sum(axis=1))
    for k in kinds:
        out[k] = parts[k]
    return out[out["busy_ms"] > 0].reset_index(drop=True) if len(out) else out


def later_collectives(comms: pd.DataFrame) -> pd.DataFrame:
    """The collectives the communication and bucket figures read: those of the steps past the first. Step 0 is DDP's
    start-up: the ranks meet there for the first time (one waited 115 to 130 ms in step 0's all-reduce for the other
    to start, in a job whose later steps took 2 ms), its first forward broadcasts the model, and DDP builds its
    buckets anew after it. A run of one step: that step's."""
    return comms[comms["step"] > comms["step"].min()] if comms["step"].nunique() > 1 else comms


def bucket_counts(comms: pd.DataFrame) -> pd.Series:
    """How many buckets (distinct collectives) each rank's steps of later_collectives ran, by (step, device), from the
    whole comms table (given later_collectives' rows, it took their first step out again). The bucket finding weighs
    their median, and the Overview and ``dpprof show`` say each rank's."""
    return later_collectives(comms).groupby(["step", "device"])["bucket"].nunique()


COMPRESSING_HOOKS = ("compress", "powersgd")  # in a hook's name: torch's fp16/bf16_compress_hook(s), PowerSGD's


def _compresses(hook: str | None) -> bool:
    """The run's communication hook sends less than its buckets hold (its bytes sent are not the buckets' size)."""
    return hook is not None and any(word in hook.lower() for word in COMPRESSING_HOOKS)


# an imported trace of FSDP: its collectives are the parameters' all-gathers and the gradients' reduce-scatters, which
# no DDP communication hook touches (FSDP2 takes none); its mixed-precision policy sends both in half the bytes
_FSDP_BYTES_WORDS = (", or gather parameters and reduce gradients in bf16: fully_shard(..., mp_policy="
                     "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)) halves the bytes of "
                     "every all-gather and reduce-scatter (FSDP1: mixed_precision=MixedPrecision(...)).")


def _compress_words(hook: str | None) -> str:
    """The communication advice's end: compress gradients with a hook, unless the run's hook already does (its bytes
    sent are then what it sent, dpprof.parallel.distributed)."""
    if hook is None:
        return ", or compress gradients with a communication hook (fp16/bf16 compress, PowerSGD)."
    if _compresses(hook):
        return (f"; the gradients already go through the compressing communication hook {hook} (the bytes sent are "
                "what it sent), so compressing them again buys little.")
    return (f", or compress gradients with a communication hook (fp16/bf16 compress, PowerSGD) in place of, or "
            f"wrapping, the run's {hook}.")


def communication(t: Tables) -> list[dict]:
    """Collectives' share of the step (their union, clipped to the step: never over 100%) and how much of it
    overlaps backward compute; bucket-size advice. A recorded DDP run's collectives are its gradient buckets'
    all-reduce; an imported trace's are what its GPU ran (all-reduce, reduce-scatter, all-to-all...), each named."""
    comms, phases = later_collectives(t.comms), t.phases  # over the steps past the first, as the buckets
    if comms.empty:
        return []
    busy_table = collective_busy(comms, t.steps)
    if busy_table.empty:
        return []
    windows = busy_table.set_index(["step", "device"])
    overlapped = [ms for key, ms in overlapped_ms(comms, phases[phases["phase"] == "backward_compute"]).items()
                  if key in windows.index]
    # per step and rank over every step from the first compared one on, a step that ran none (an evaluation pass
    # between training steps) counting 0: the mean over the steps that ran some, set against every step, overstated
    # the share, and the cost over the run counted the steps that ran none
    steps = t.steps.assign(rank=t.steps.get("rank", 0))
    window = steps[(steps["step"] >= comms["step"].min()) & steps["rank"].isin(comms["rank"].unique())]
    slots = max(len(window[["rank", "step"]].drop_duplicates()), len(busy_table))
    comm_ms = float(busy_table["busy_ms"].sum()) / slots
    without = window["step"].nunique() - busy_table["step"].nunique()
    # the job's mean step past the first (the slowest rank's, as the data finding's), the step the ranks pay together;
    # a run of one step: the ranks' own steps
    later = t.later_steps
    step_ms = float(later.mean()) if len(later) else float(busy_table["window_ms"].mean())
    share = comm_ms / step_ms if step_ms else 0.0
    overlap = min(1.0, sum(overlapped) / busy_table["busy_ms"].sum()) if busy_table["busy_ms"].sum() else 0.0
    exposed_ms = comm_ms * (1 - overlap)
    kinds = [k for k in busy_table.columns if k not in ("step", "device", "window_ms", "busy_ms")]
    named = t.model.named_collectives  # an imported trace: say what its collectives are (a DDP run's: its gradient buckets')
    what = "collectives" if named else "gradient all-reduce"
    each = ": " + ", ".join(f"{k} {busy_table[k].sum() / slots:.2f} ms" for k in kinds) if named else ""
    if without > 0:
        each += f" (none in {without:,} of those {window['step'].nunique():,} steps)"
    findings = []
    if share >= COMM_SHARE_WARN and worth_time(comm_ms, step_ms):
        findings.append(finding("communication_share", "warning", None,
                                f"{what} {'are' if named else 'is'} busy {share:.0%} of the step, {overlap:.0%} of "
                                "it overlapped",
                                f"{what} busy {comm_ms:.2f} ms per step per rank of a {step_ms:.2f} ms mean "
                                f"step past the first{each}; "
                                f"{overlap:.0%} of it ran while backward was still computing; the rest "
                                f"{cost_text(exposed_ms, t.later_step_count)}" + _partial_job_words(t.model),
                                ("Bring every rank's file into the run first (import them together, or dpprof merge): "
                                 "a rank the others wait for is then named the straggler, and that wait is no cost of "
                                 "communication. Otherwise: r" if t.model.partial_job else "R")
                                + "aise the per-rank batch (communication is per step, compute per sample)"
                                + (_FSDP_BYTES_WORDS if t.model.sharded else _compress_words(t.model.comm_hook)),
                                share, "share"))
    per_step_buckets = bucket_counts(t.comms).median()  # over the steps past the first: it takes them itself
    mean_bytes = comms["bucket_bytes"].mean()
    sized = pd.notna(mean_bytes)  # a gloo trace's collectives may name no size
    if per_step_buckets <= FEW_BUCKETS and share >= COMM_SHARE_WARN / 2 and worth_time(exposed_ms, step_ms):
        findings.append(finding("bucket_size", "info", None, "all gradients travel in one bucket",
                                f"{per_step_buckets:.0f} bucket per step"
                                + (f" of {mib(mean_bytes)}" if sized else " (its size is not in the trace)")
                                + f"; {overlap:.0%} overlap; the all-reduce after backward "
                                f"{cost_text(exposed_ms, t.later_step_count)}",
                                ("The gradients are small: their one all-reduce costs its latency, which smaller "
                                 "buckets would pay several times over. All-reduce less often: raise the per-rank batch, "
                                 + _accumulate_words(_micro_batches(t.steps, comms))
                                 if sized and mean_bytes < SMALL_BUCKET_BYTES else
                                 "With one bucket the all-reduce starts only when backward has finished: lower "
                                 "bucket_cap_mb (DDP's default is 25)" + _cap_words(mean_bytes, sized, t.model.comm_hook)
                                 + " so it overlaps."), per_step_buckets, "count"))
    elif per_step_buckets > MANY_BUCKETS and mean_bytes < SMALL_BUCKET_BYTES and worth_time(comm_ms, step_ms):
        findings.append(finding("bucket_size", "info", None, f"{per_step_buckets:.0f} small buckets per step",
                                f"{per_step_buckets:.0f} buckets of {mib(mean_bytes)} on average; the "
                                f"all-reduce is busy {comm_ms:.2f} ms a step",
                                "Each all-reduce pays a fixed latency: raise bucket_cap_mb.", per_step_buckets,
                                "count"))
    return findings


def _micro_batches(steps: pd.DataFrame, comms: pd.DataFrame) -> int:
    """How many micro-batches the run's steps with an all-reduce accumulate under no_sync() (their median forward
    calls, where those steps reduce their gradients once: each bucket once); 1 where they do not accumulate so."""
    if "forward_calls" not in steps.columns or comms.empty:
        return 1
    launches = comms.groupby(["step", "rank"]).agg(rows=("bucket", "size"), buckets=("bucket", "nunique"))
    calls = steps.set_index(["step", "rank"])["forward_calls"].reindex(launches.index)
    once = calls[(launches["rows"] == launches["buckets"]).to_numpy()].dropna()
    if len(once) * 2 <= len(launches):  # most steps reduce more than once (or their calls are unknown)
        return 1
    return max(1, int(once.median()))


def _accumulate_words(micro_batches: int) -> str:
    """The bucket advice's end: accumulate under no_sync(), or more, where the run already does (a step of N forward
    calls reducing its gradients once)."""
    if micro_batches > 1:
        return (f"or accumulate gradients over more micro-batches under no_sync() (the run already accumulates "
                f"{micro_batches} a step).")
    return "or accumulate gradients over micro-batches under no_sync()."


def _cap_words(sent_bytes: float, sized: bool, hook: str | None) -> str:
    """What to lower bucket_cap_mb to: under a quarter of the one bucket, so it splits in four. The bucket's size is
    what it sent, but for a compressing hook's (half under fp16 compress, PowerSGD's low-rank factors): no figure."""
    if _compresses(hook):
        return f" (to a quarter of the gradients' size: the {mib(sent_bytes)} a step is what {hook} sent)"
    return f" to below {sent_bytes / 2**20 / 4:.2g}" if sized else ""


def _partial_job_words(model: RunModel) -> str:
    """What a run of some of a job's ranks cannot tell apart inside its collectives ("" for a whole job): a rank that
    waits there for a slower rank not in the run looks busy communicating, and no straggler finding names the other."""
    if not model.partial_job:
        return ""
    of = f"the job's {model.world_size}" if model.world_size else "the job's"
    held = len(model.ranks)
    return (f"; only {held} of {of} ranks {'is' if held == 1 else 'are'} in this run: time inside a collective "
            "includes waiting for a slower rank among the others")


def uneven_inputs(t: Tables) -> list[dict]:
    """Ranks fed different batch sizes in the same training step (evaluation steps, forwards alone between them, train
    nothing: ranks evaluating shards of a set that does not divide among them are no skewed gradient)."""
    steps = t.steps
    if t.steps["rank"].nunique() < 2 or steps["batch_size"].isna().all():
        return []
    # the rule throughput shares (training_steps_of); a run read from its aggregates has no whole phases
    backward = t.backward_steps
    training = None if backward is None else training_steps_of(backward, steps["step"])
    if training is not None:
        steps = steps[steps["step"].isin(list(training))]
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
                    "drop_last=True, or the join() context manager for uneven inputs.", len(uneven) / len(spread),
                    "share")]
