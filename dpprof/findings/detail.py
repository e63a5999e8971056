"""Rules over what a run's operators, kernels and memory show (an imported trace, or a recorded run's deep
capture): data loading's share of the step, GPU utilization, tensor-core-eligible work without tensor cores, peak
memory near the GPU's capacity; and, for a straggler or memory finding, the operators that explain it.

Each figure is read from the stored tables (dpprof.store.detail_rows, read once into ``Tables.detail`` by
``operator_data``), never computed again here: the GPU utilization is the Kernels page's, the peak the Memory
page's, the operator differences the Operators page's side by side (dpprof.views.opdiff).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from dpprof.findings.base import OperatorData, Tables, finding, per_step
from dpprof.findings.floors import cost_text, critical_share_or, mib, worth_time
from dpprof.loaders import none_iterated
from dpprof.store import detail_rows
from dpprof.store.reader import StoredRun
from dpprof.units import plural
from dpprof.views.opdiff import Pick, at_steps, diff_rows, diff_sentence, others_mean_of, side_of

__all__ = ["DATA_SHARE_WARN", "GPU_UTIL_LOW_PCT", "TC_UNUSED_SHARE", "MEMORY_FULL_SHARE", "EXPLAIN_TOP",
           "SUPERSEDES", "NO_LOADER_WORDS", "operator_data", "workers_advice", "no_data_loader", "data_loading", "gpu_utilization", "tensor_cores_unused", "memory_full",
           "DETAIL_RULES", "explain"]

# Loading the batch over 5% of the step: the step waits on the input pipeline (the figure; the TensorBoard
# plugin's overview recommends DataLoader workers from about there). Under it, more workers buy back little.
DATA_SHARE_WARN = 0.05
# GPU busy (a kernel running) under half the step: the GPU waits on the host more than it works (the plugin's
# overview recommends a bigger batch below this; HTA's idle breakdown flags the same).
GPU_UTIL_LOW_PCT = 50.0
# Kernels of tensor-core-eligible operators that ran without tensor cores, over a tenth of the GPU's kernel time:
# on tensor cores such kernels run 2-8x faster (NVIDIA's mixed-precision guide), so below a tenth mixed precision
# would buy back under a tenth of the GPU time, within what a batch-size change moves.
TC_UNUSED_SHARE = 0.10
# Peak allocated over 90% of the GPU's memory (deviceProperties' totalGlobalMem): the caching allocator's
# reserved blocks and fragmentation take about the rest (PyTorch's CUDA memory notes), so a longer input or a
# bigger batch runs out of memory.
MEMORY_FULL_SHARE = 0.90
EXPLAIN_TOP = 3  # operators named behind a slow device: the first three explain most of a difference in practice
# A finding of the first kind on a device says all of the second's on that device (both read the GPU idle):
# the second is dropped there.
SUPERSEDES = {"gpu_utilization": "gpu_idle"}


def operator_data(run: StoredRun) -> OperatorData | None:
    """The run's operator-level tables for the rules, or None where it has none (detail_rows.detail_missing)."""
    if detail_rows.detail_missing(run) is not None:
        return None
    gpu_steps = detail_rows.gpu_metrics(run)
    steps_of = {(rank, device): int(n) for (rank, device), n in
                gpu_steps.groupby(["rank", "device"], dropna=False)["step"].nunique().items()}
    held = detail_rows.detail_steps_of(run)  # each rank's tables may span their own steps (an imported job)
    operator_steps_of = held if len(set(held.values())) > 1 else {}
    return OperatorData(operators=detail_rows.operators(run), operator_steps=detail_rows.detail_step_count(run),
                        kernel_ops=detail_rows.kernels(run, by="operator"),
                        gpu=detail_rows.gpu_summary(run), gpu_steps=int(gpu_steps["step"].nunique()),
                        gpu_steps_of=steps_of,
                        peaks=detail_rows.memory_peaks(run), operator_memory=detail_rows.operator_memory(run),
                        devices=run.table("devices"), operator_steps_of=operator_steps_of)


def _gpu_data_ms(t: Tables, device: str, steps: pd.Index) -> float | None:
    """The mean over ``steps`` of the data part's GPU time on ``device`` (a DDP rank on a GPU: CUDA events from the
    previous step's last work on the GPU to forward's first), or None where the run has none for every one of them."""
    if "device_duration_ms" not in t.phases.columns:
        return None
    rows = t.phases[(t.phases["phase"] == "data") & (t.phases["device"] == device) & t.phases["step"].isin(steps)]
    gpu = rows.groupby("step")["device_duration_ms"].sum(min_count=1)
    if gpu.empty or gpu.isna().any() or len(gpu) < len(steps):
        return None
    return float(gpu.mean())


def _ranks_of(t: Tables, device: str) -> list[int]:
    """The ranks (0 for a one-file run) whose phases are on this device."""
    return [int(r) for r in t.phases.loc[t.phases["device"].astype(str) == device, "rank"].dropna().unique()]


def _loaders_of(t: Tables, device: str) -> list[dict[str, Any]]:
    """The DataLoaders of the rank (or one-file run) whose device this is, as the run stored them (dpprof.loaders)."""
    if not t.data_loaders:
        return []
    return [d for rank in _ranks_of(t, device) for d in t.data_loaders.get(rank, [])]


# What a GPU idle for want of the host is told of its input where its process iterated no DataLoader (no_data_loader):
# the batch is the script's own work, which DataLoader workers do not speed up.
NO_LOADER_WORDS = ("the script's own work between steps (it iterates no DataLoader: building the batch in "
                   "the loop, logging, checkpoints)")


def no_data_loader(t: Tables, device: str) -> bool:
    """Whether the process of this device was recorded with the DataLoader watch on and iterated none (its batches
    built in the loop, or another source): its data part is then no DataLoader's loading (dpprof.loaders)."""
    return none_iterated(t.data_loaders, _ranks_of(t, device))


def workers_advice(loaders: list[dict[str, Any]], on_gpus: bool = True) -> tuple[str, str | None]:
    """What the evidence says of the process's DataLoaders, and where every one already loads in worker processes,
    what is left to advise, as a list in words (never num_workers it already has; pin_memory and work moved to the GPU
    only where the run trains on GPUs: a loader pins memory only for an accelerator, and torch warns where it finds
    none); ("", None) where the run does not say, and None where one loads without workers (the rule's own advice:
    load in workers)."""
    if not loaders:
        return "", None
    without = sum(not d["workers"] for d in loaders)
    if without:
        whose = "the DataLoader loads" if len(loaders) == 1 else f"{without} of its {len(loaders)} DataLoaders load"
        return f"; {whose} in the training process (num_workers=0)", None
    counts = sorted({d["num_workers"] for d in loaders if isinstance(d.get("num_workers"), int)})
    if counts and len(counts) == sum(isinstance(d.get("num_workers"), int) for d in loaders) == len(loaders):
        said = f"num_workers={'/'.join(map(str, counts))}"
        more = f"more workers than {max(counts)} (while CPU cores are free)"
    else:  # a trace: its _MultiProcessingDataLoaderIter says workers, not how many
        said = "worker processes (the trace's _MultiProcessingDataLoaderIter)"
        more = "more workers (while CPU cores are free)"
    left = [more]
    if any(d.get("persistent_workers") is False for d in loaders):
        left.append("persistent_workers=True (its workers start again each epoch)")
    elif not any("persistent_workers" in d for d in loaders):
        left.append("persistent_workers=True")
    if on_gpus and not any(d.get("pin_memory") is True for d in loaders):
        left.append("pin_memory=True")
    factors = sorted({d["prefetch_factor"] for d in loaders if isinstance(d.get("prefetch_factor"), int)})
    left.append(f"a larger prefetch_factor (it is {'/'.join(map(str, factors))})" if factors
                else "a larger prefetch_factor")
    cheaper = ("decoding and augmentation moved to the GPU, or data stored decoded" if on_gpus
               else "data stored decoded")
    return f"; the DataLoader already loads in {said}", f"{', '.join(left)}, and cheaper work per sample ({cheaper})"


def data_loading(t: Tables) -> list[dict]:
    """Loading the batch (the step model's ``data`` part) over DATA_SHARE_WARN of the step, per device or rank.

    A rank on a GPU with its parts' CUDA-event times (dpprof.parallel.distributed) also gets the data part's GPU
    time: how long the GPU had nothing to do for want of the batch. The rest of the host's part ran while the GPU was
    still busy with the previous step (the host loading behind it, or waiting for it in a blocking copy of the batch):
    it costs the GPU nothing. The advice follows whichever is larger, and the severity the GPU's own wait.

    A process recorded with the DataLoader watch on that iterated none (dpprof.loaders.none_iterated) loaded nothing
    through a DataLoader: the part is then said as the time before its forward, the script's own work since the
    optimizer step (building the batch in the loop, logging, checkpoints), and its advice is to move that work off
    the step, never DataLoader workers."""
    if "data" not in t.model.phases or t.phases.empty:
        return []
    data = per_step(t, ["data"])
    steps = t.step_durations_ms
    out = []
    for device in data.columns:
        col = data[device].dropna()
        step_ms = steps.reindex(col.index).dropna()
        col = col.reindex(step_ms.index)
        if col.empty or not step_ms.sum():
            continue
        share = float(col.sum() / step_ms.sum())
        data_ms, mean_step = float(col.mean()), float(step_ms.mean())
        if share <= DATA_SHARE_WARN or not worth_time(data_ms, mean_step):
            continue
        # a rank whose trace holds fewer steps than the job's longest (its profiler's window): over its own steps
        whose = "the run's" if len(col) == t.later_step_count else f"{device}'s"
        own = no_data_loader(t, str(device))  # no DataLoader ran: the script's own work before forward
        what = "the time from the previous step's end to forward" if own else "loading the batch"
        evidence = (f"{what} takes {data_ms:.2f} ms of a {mean_step:.2f} ms step on average "
                    f"({plural(len(col), 'step')}, the first left out): it {cost_text(data_ms, len(col), whose)}")
        if own:
            evidence += ("; no DataLoader was iterated in this process while it was recorded, so this is the "
                         "script's own work between the optimizer step and the next forward")
            advice = ("No DataLoader loads here: the step waits for the script's own code between the optimizer step "
                      "and the next forward (building or reading the batch in the loop, logging and metrics, "
                      "checkpointing, evaluation, a host synchronisation such as .item() or .cpu()). Move it off the "
                      "step: build batches in the background or on the GPU, log and checkpoint every N steps rather "
                      "than every step, and evaluate less often; dpprof run --capture 5:8 train.py, then dpprof ops "
                      "RUN, shows it by operator.")
        else:
            advice = ("The step waits for its input: load in DataLoader worker processes (num_workers=4 or more, "
                      "persistent_workers=True), " + ("with pin_memory=True, and move decoding and augmentation there "
                                                      "or to the GPU." if t.on_gpus else
                                                      "and move decoding and augmentation there."))
            said, left = workers_advice(_loaders_of(t, str(device)), t.on_gpus)
            evidence += said
            if left is not None:
                advice = ("The step waits for its input although the DataLoader already loads in worker processes: "
                          f"they do not keep up. What is left: {left}.")
        gpu_ms = _gpu_data_ms(t, str(device), col.index)
        # a process whose model is on a GPU (its allocator read): the host's part before forward also holds the
        # wait for the GPU to finish the previous step, where the batch's copy to the GPU blocks (pageable memory)
        on_gpu = not t.allocator.empty and str(device) in set(t.allocator["device"])
        copy_advice = (" Copy the batch with .to(device, non_blocking=True) from pinned memory, so the copy does not "
                       "wait for the GPU: what is left of this part is then "
                       + ("the script's own work." if own else "loading."))
        if gpu_ms is not None:
            behind = max(0.0, data_ms - gpu_ms)  # ran while the GPU was still busy with the previous step
            evidence += (f"; of it, the GPU sat {gpu_ms:.2f} ms a step waiting for "
                         + ("the next forward" if own else "the batch") + f", and the other {behind:.2f} ms ran while "
                         "the GPU was still busy with the previous step's work (the host "
                         + ("working" if own else "loading") + " behind it, or waiting for it in a blocking copy of "
                         "the batch; CUDA events on the rank's stream)")
            if behind > gpu_ms:
                advice = ("Most of this part runs while the GPU is still busy with the previous step, so the GPU is "
                          "the bound: " + ("less host work there" if own else "faster input")
                          + f" buys back at most the GPU's {gpu_ms:.2f} ms a step. A batch copied from memory that is "
                          "not pinned also waits for the GPU." + copy_advice)
            else:
                advice += copy_advice
        elif on_gpu:
            evidence += ("; on a GPU this host time also holds any wait for the GPU to finish the previous step's "
                         "work before a blocking copy of the batch (from memory that is not pinned), which this run "
                         "does not separate from " + ("the script's own work" if own else "loading"))
            advice += copy_advice
        # how bad: the host's share, or where the GPU's own wait is known, that (the rest cost the GPU nothing)
        bound = share if gpu_ms is None else gpu_ms / mean_step
        severity = critical_share_or("warning" if bound > DATA_SHARE_WARN else "info", bound)
        title = f"{device} spends {share:.0%} of the step " + ("before its forward" if own else "loading data")
        out.append(finding("data_loading", severity, str(device), title, evidence, advice, share, "share"))
    return out


def gpu_utilization(t: Tables) -> list[dict]:
    """A GPU busy (a kernel running) under GPU_UTIL_LOW_PCT of the steps (the Kernels page's utilization)."""
    d = t.detail
    if d is None or d.gpu.empty:
        return []
    out = []
    for row in d.gpu.dropna(subset=["utilization_pct"]).itertuples(index=False):
        util = float(row.utilization_pct)
        steps = max(d.gpu_steps_of.get((row.rank, row.device), d.gpu_steps), 1)  # this GPU's own steps
        idle_ms, step_ms = (row.window_ms - row.busy_ms) / steps, row.window_ms / steps
        if util >= GPU_UTIL_LOW_PCT or not worth_time(idle_ms, step_ms):
            continue
        out.append(finding(
            "gpu_utilization", "critical" if util < GPU_UTIL_LOW_PCT / 2 else "warning", str(row.device),
            f"{row.device}'s GPU utilization is {util:.0f}%",
            f"a kernel ran {row.busy_ms:,.1f} ms of {row.window_ms:,.1f} ms ({plural(steps, 'step')}); est. SM "
            f"efficiency {row.sm_efficiency_pct:.0f}%, est. achieved occupancy {row.achieved_occupancy_pct:.0f}%: "
            f"the time no kernel runs (memcpy and memset count as idle here, as in the plugin's utilization; the "
            f"GPU time table's idle leaves them out) {cost_text(idle_ms, steps)}",
            "The GPU waits on the host: give it more work per kernel (a bigger batch), fewer host synchronisations "
            "(.item(), .cpu(), printing tensors inside the step), "
            + ("less of " + NO_LOADER_WORDS if no_data_loader(t, str(row.device)) else "faster input (DataLoader workers)")
            + ", or fewer launches (torch.compile, CUDA graphs).", util / 100, "share"))
    return out


def tensor_cores_unused(t: Tables) -> list[dict]:
    """Kernels of tensor-core-eligible operators without tensor cores over TC_UNUSED_SHARE of a GPU's kernel time."""
    d = t.detail
    if d is None or d.kernel_ops.empty:
        return []
    eligible = set(d.operators.loc[d.operators["tc_eligible"].fillna(False).astype(bool), "name"])
    k = d.kernel_ops
    out = []
    for device, rows in k.groupby("device", sort=False):
        total = float(rows["total_ms"].sum())
        mine = rows[rows["operator"].isin(eligible)]
        plain = mine[~mine["tensor_cores"].fillna(False).astype(bool)]
        plain_ms, eligible_ms = float(plain["total_ms"].sum()), float(mine["total_ms"].sum())
        if not total or plain_ms / total < TC_UNUSED_SHARE:
            continue
        steps = max(d.gpu_steps, 1)
        top = plain.groupby("operator")["total_ms"].sum().nlargest(3)
        ops = ", ".join(f"{op} {ms:,.1f} ms" for op, ms in top.items())
        out.append(finding(
            "tensor_cores_unused", "warning", str(device),
            f"{plain_ms / total:.0%} of {device}'s kernel time could run on tensor cores and does not",
            f"kernels of tensor-core-eligible operators ran {eligible_ms:,.1f} ms, {plain_ms:,.1f} ms of it without "
            f"tensor cores ({plain_ms / total:.0%} of {total:,.1f} ms of kernels; {ops}): "
            f"{plain_ms / steps:.2f} ms a step on {plural(steps, 'step')}",
            "Run these operators in mixed precision: torch.autocast(device_type='cuda', dtype=torch.bfloat16) (or "
            "float16 with torch.amp.GradScaler); on Ampere and later, TF32 for float32 matmuls and convolutions "
            "(torch.backends.cuda.matmul.allow_tf32 = True, torch.backends.cudnn.allow_tf32 = True).",
            plain_ms / total, "share"))
    return out


def memory_full(t: Tables) -> list[dict]:
    """Peak allocated memory over MEMORY_FULL_SHARE of the GPU's memory (deviceProperties' totalGlobalMem)."""
    d = t.detail
    if d is None or d.peaks.empty or d.devices.empty or "total_memory_bytes" not in d.devices:
        return []
    capacity = d.devices.dropna(subset=["total_memory_bytes"]).set_index(["rank", "device"])["total_memory_bytes"]
    out = []
    for row in d.peaks.itertuples(index=False):
        total = capacity.get((row.rank, row.device))
        if total is None or not total or pd.isna(row.peak_allocated_bytes):
            continue
        share = float(row.peak_allocated_bytes) / float(total)
        if share <= MEMORY_FULL_SHARE:
            continue
        step = f"in step {int(row.peak_step)}" if pd.notna(row.peak_step) else "outside every step"
        out.append(finding(
            "memory_full", "critical" if share >= 0.98 else "warning", str(row.device),
            f"{row.device} peaks at {share:.0%} of its memory",
            f"peak allocated {mib(row.peak_allocated_bytes)} of {mib(total)} {step}, "
            f"{row.peak_t_ms:,.1f} ms into the run: {mib(total - row.peak_allocated_bytes)} left, which the "
            "allocator's cache and fragmentation take; a bigger batch or a longer input runs out of memory",
            "Keep fewer activations: activation checkpointing (torch.utils.checkpoint) on the largest blocks, mixed "
            "precision (half the bytes per activation), or a smaller batch with gradient accumulation.", share,
            "share"))
    return out


DETAIL_RULES = (data_loading, gpu_utilization, tensor_cores_unused, memory_full)

_EXPLAINED = ("straggler", "straggler_rank", "memory_skew")


def _memory_sentence(d: OperatorData, device: str) -> str | None:
    """The operators that allocate more on ``device`` than on the other devices on average."""
    mem = d.operator_memory
    if mem.empty or device not in set(mem["device"]):
        return None
    per = mem.groupby(["device", "name"])["allocated_bytes"].sum().unstack("device").fillna(0)
    if per.shape[1] < 2:
        return None
    extra = (per[device] - per.drop(columns=device).mean(axis=1)).nlargest(EXPLAIN_TOP)
    extra = extra[extra > 0]
    if extra.empty:
        return None
    return (f"operators allocating more on {device} than on the others on average: "
            + ", ".join(f"'{n}' +{mib(b)}" for n, b in extra.items()))


def _at_steps_of(ops: pd.DataFrame, d: OperatorData, device: str) -> tuple[pd.DataFrame, int, str]:
    """The operators with each rank's calls and times scaled to the step count of ``device``'s rank, where the ranks'
    tables span different step counts (d.operator_steps_of), so that the others' totals are set against the device's
    over as many steps; with the step count and the others' label. Unchanged where every rank's span the same."""
    held = d.operator_steps_of
    own = ops.loc[ops["device"] == device, "rank"].unique()
    if not held or len(own) != 1 or not held.get(int(own[0])):
        return ops, d.operator_steps, "the others' mean"
    steps = held[int(own[0])]
    return at_steps(ops, held, steps), steps, f"the others' mean (each rank's scaled to {plural(steps, 'step')})"


def explain(rows: list[dict], t: Tables) -> list[dict]:
    """Each straggler or memory finding on a device with operator data gains the operators behind it: the device's
    difference from the mean of the others (dpprof.views.opdiff, the Operators page's side by side)."""
    d = t.detail
    if d is None:
        return rows
    ops = d.operators[d.operators["device"].isin(t.model.devices)]  # the run's devices: not a capture's "host"
    if ops.empty or ops["device"].nunique() < 2:
        return rows
    for row in rows:
        device = str(row.get("device"))
        if row["kind"] not in _EXPLAINED or device not in set(ops["device"]):
            continue
        pick = Pick(device=device)
        lead = "Operators behind it"
        if row["kind"] == "memory_skew":
            sentence = _memory_sentence(d, device)
        else:
            same, steps, label = _at_steps_of(ops, d, device)
            diff = diff_rows(others_mean_of(same, pick), side_of(same, pick))
            sentence = diff_sentence(diff, label, device, top=EXPLAIN_TOP, quote="'",
                                     steps=steps) if len(diff) else None
            if sentence and float(diff["delta_ms"].sum()) < 0:
                # a rank late for what it does outside its operators (a sleep, its own logging after the step): they
                # are faster than the others', and "behind it" said the opposite of what they show
                lead = "Not its operators, which are faster than the others'"
        if sentence:
            row["evidence"] += f". {lead} (Operators page, side by side): {sentence}"
    return rows
