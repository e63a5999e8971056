"""Rules for DataParallel's steps (recorded, balanced, or a trace of dpprof.DataParallel): the straggler, the
output device's memory, the DataParallel tax, uneven and idle chunks, backward's share."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.findings.base import MEDIAN_STEP, Tables, finding, per_step
from dpprof.findings.collectives import CollectiveVerdict, collective_verdict
from dpprof.findings.floors import (STEP_SHARE_FLOOR, TIME_FLOOR_MS, Imbalance, cost_text, critical_or,
                                    critical_share_or, imbalance, mib, total_text, worth_bytes, worth_time)
from dpprof.records import DP_TAX_PHASES, MEMORY_BYTES, idle_severity, split_shares, uneven_severity

__all__ = ["STRAGGLER_RATIO", "STRAGGLER_RATIO_CPU", "STRAGGLER_CONSISTENCY", "straggler_severity",
           "MEMORY_SKEW_RATIO", "MEMORY_SKEW_CRITICAL_RATIO", "DP_TAX_WARN", "UNEVEN_STEPS_SHARE",
           "BACKWARD_SHARE_INFO", "Straggler", "straggler_threshold", "straggler_verdict", "straggler_row", "straggler", "memory_skew", "DataParallelTax",
           "dataparallel_tax_of", "dataparallel_tax",
           "SplitCost", "split_cost", "uneven_chunks", "backward_share"]

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


def straggler_severity(wait_ms: float, step_ms: float) -> str:
    """A straggler's severity, one rule however it was found (from the work times or from the collectives): critical
    where the others' wait for it is at least CRITICAL_STEP_SHARE of the median step past the first, as any time
    finding's cost, else a warning."""
    return critical_or("warning", wait_ms, step_ms)


def straggler_threshold(t: Tables) -> float:
    """STRAGGLER_RATIO_CPU where devices share the host's cores (CPU workers, ranks on CPUs), else STRAGGLER_RATIO."""
    return STRAGGLER_RATIO if t.on_gpus else STRAGGLER_RATIO_CPU


@dataclass(frozen=True)
class Straggler:
    """The one verdict on the slowest device (or rank): the straggler finding, the Overview's headline and every page
    read it, so they name the same device with the same wait, and a device not called a straggler is said to be
    one short of it for the reason the rule used."""

    found: Imbalance
    work: str  # the run's work in words: "apply", "forward + backward compute"
    unit: str  # "device" or "rank"
    threshold: float  # the ratio a straggler needs here (straggler_threshold)
    step_ms: float  # the median step the wait is weighed against (the first step left out)
    later_steps: int  # the steps the wait is paid over (the run's, less its first)
    reason: str | None  # None for a straggler; else the first of the rule's tests it failed, in words
    # the verdict from the collectives themselves (dpprof.findings.collectives), where the run's ranks have matched
    # collectives: it decides the rank and the wait then, and ``found`` gives each rank's work beside it
    collectives: CollectiveVerdict | None = None

    @property
    def slowest(self) -> str:
        return self.collectives.straggler if self.collectives is not None else self.found.slowest

    @property
    def ratio(self) -> float:
        """The slowest's median work over the others' median (``found``'s figures for the device named)."""
        if self.collectives is None:
            return self.found.ratio
        medians = self.found.medians
        if self.slowest not in medians.index:
            return float("nan")
        others = float(medians.drop(self.slowest).median())
        return float(medians[self.slowest] / others) if others else float("inf")

    @property
    def wait_ms(self) -> float:
        return self.collectives.wait_ms if self.collectives is not None else self.found.wait_ms_per_step

    @property
    def reported(self) -> bool:
        return self.reason is None

    @property
    def wait_share(self) -> float:
        """The others' wait for it as a share of the median step past the first: the straggler finding's value,
        however it was found."""
        return self.wait_ms / self.step_ms

    @property
    def severity(self) -> str:
        """The straggler finding's severity (straggler_severity of its wait and the median step past the first)."""
        return straggler_severity(self.wait_ms, self.step_ms)

    def sentence(self) -> str:
        """The verdict in one sentence, with its figures: the Overview's headline."""
        f, slow = self.found, self.slowest
        c = self.collectives
        if c is not None and self.reported:
            return (f"{slow} is the slowest to reach the collectives: inside them they wait {c.wait_ms:.2f} ms per "
                    f"step for it ({self.wait_share:.0%} of the {c.step_words}); it waited least in {c.share:.0%} "
                    f"of {c.steps} steps.")
        if c is not None:
            return (f"No straggler: inside the collectives {slow} waits least, the others "
                    f"{c.wait_ms:.2f} ms per step more, but {self.reason}.")
        if self.reported:
            return (f"{slow} is the slowest: {self.work} {f.medians[slow]:.2f} ms per step, {self.ratio:.2f}x the "
                    f"others' {f.others_ms:.2f} ms; they wait {self.wait_ms:.2f} ms per step for it.")
        return (f"No straggler: the slowest {self.unit}, {slow}, takes {self.ratio:.2f}x the others' median "
                f"{self.work} ({self.wait_ms:.2f} ms per step more), but {self.reason}.")


def straggler_verdict(t: Tables) -> Straggler | None:
    """The slowest device's imbalance over the run's work (run.model.work, the first step left out; a process's data
    too: a rank that loads slowly holds the all-reduce up as one that computes slowly) and whether it
    is a straggler: ratio at least straggler_threshold, the slowest in STRAGGLER_CONSISTENCY of steps, and a wait
    that clears the findings' floors. None with fewer than two devices or three steps."""
    phases, work = list(t.model.work.phases), t.model.work.label
    if not t.model.dataparallel and "data" in t.model.phases:  # a rank's gradients are ready after its data too
        phases, work = ["data", *phases], f"data + {work}"
    found = imbalance(per_step(t, phases))
    if found is None:
        return None
    if not t.model.dataparallel and (by_collectives := collective_verdict(t)) is not None:
        # one verdict per run: where the ranks' collectives match, the wait inside them names the straggler
        return Straggler(found=found, work=work, unit=t.model.unit, threshold=by_collectives.threshold,
                         step_ms=by_collectives.step_ms, later_steps=t.later_step_count, reason=by_collectives.reason,
                         collectives=by_collectives)
    threshold, step_ms, wait = straggler_threshold(t), t.median_step_ms, found.wait_ms_per_step
    reason = None
    if found.ratio < threshold:
        shared = " where devices share the host's cores" if threshold == STRAGGLER_RATIO_CPU else ""
        reason = f"{found.ratio:.2f}x is under the {threshold:.2f}x a straggler needs{shared}"
    elif found.slowest_share < STRAGGLER_CONSISTENCY:
        reason = (f"it was the slowest in only {found.slowest_share:.0%} of {found.steps} steps, under the "
                  f"{STRAGGLER_CONSISTENCY:.0%} a straggler needs")
    elif not worth_time(wait, step_ms):
        reason = (f"{wait:.2f} ms a step is under the {TIME_FLOOR_MS} ms floor a finding needs"
                  if wait < TIME_FLOOR_MS or not step_ms or pd.isna(step_ms) else
                  f"{wait / step_ms:.1%} of the {step_ms:.2f} ms {MEDIAN_STEP} is under the {STEP_SHARE_FLOOR:.0%} "
                  "floor a finding needs")
    return Straggler(found=found, work=work, unit=t.model.unit, threshold=threshold, step_ms=step_ms,
                     later_steps=t.later_step_count, reason=reason)


def straggler_row(v: Straggler, kind: str, title: str, measure: str, advice: str) -> dict:
    """The straggler finding of a verdict: its figures, as the headline states them. Its value is the others' wait
    as a share of the median step past the first, as a straggler found from the collectives states it and as its
    severity weighs it (straggler_severity); the ratio is in its title."""
    f, slow = v.found, v.slowest
    return finding(kind, v.severity, slow, title,
                   f"{measure} {f.medians[slow]:.2f} ms on {slow} vs {f.others_ms:.2f} ms on the others; slowest in "
                   f"{f.slowest_share:.0%} of {f.steps} steps; the others wait {v.wait_ms:.2f} ms per step, "
                   f"{total_text(v.wait_ms * v.later_steps)} over the run ({v.wait_share:.0%} of the "
                   f"{MEDIAN_STEP})", advice, v.wait_share, "share")


def straggler(t: Tables) -> list[dict]:
    v = straggler_verdict(t)
    if v is None or not v.reported:
        return []
    slow = v.slowest
    return [straggler_row(v, "straggler", f"{slow} is the straggler: its apply takes {v.ratio:.2f}x the others'", "median apply",
                          f"Every step waits for {slow}. If its chunk is bigger or its inputs longer (sorted or bucketed "
                          f"batches), shuffle within the batch or balance by cost; if it is a slower or busier device, "
                          f"leave it out of device_ids.")]


def _held(memory: pd.DataFrame) -> pd.DataFrame:
    per = memory.groupby(["device", "step"])[list(MEMORY_BYTES)].sum()
    per["held_bytes"] = per.sum(axis=1)
    return per


def memory_skew(t: Tables) -> list[dict]:
    """The output device's memory over the others' (the fullest's where nothing is gathered onto one of them), among
    the devices the batch is spread over: outputs gathered onto the host (output_device -1) are off them, as the user
    chose, and the host's memory is no device's to compare."""
    spread = list(t.model.spread)
    memory, allocator = t.memory[t.memory["device"].isin(spread)], t.allocator[t.allocator["device"].isin(spread)]
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
                    "chunk, buffers or tensors the model puts on device_ids[0]).", ratio, "ratio")]


@dataclass(frozen=True)
class DataParallelTax:
    """The DataParallel tax, per step past the first (the first carries one-time costs): scatter, replicate and gather,
    the work only DataParallel does. The finding states it, the Overview's section and Compare say it."""

    by_phase_ms: dict[str, float]  # mean ms a step of each of DP_TAX_PHASES
    ms: float  # their sum: mean ms a step
    step_ms: float  # the mean step past the first
    share: float  # ms / step_ms


def dataparallel_tax_of(t: Tables) -> DataParallelTax | None:
    """The run's DataParallel tax from the tables the rules read; None without phases or a step past the first."""
    steps = t.later_steps
    if t.phases.empty or steps.empty:
        return None
    tax = t.phases[t.phases["phase"].isin(DP_TAX_PHASES) & t.phases["step"].isin(steps.index)]
    by_phase = tax.groupby("phase")["duration_ms"].sum() / len(steps)
    tax_ms, step_ms = float(by_phase.sum()), float(steps.mean())
    return DataParallelTax(by_phase_ms={p: float(by_phase.get(p, 0.0)) for p in DP_TAX_PHASES}, ms=tax_ms,
                           step_ms=step_ms, share=tax_ms / step_ms if step_ms else 0.0)


def dataparallel_tax(t: Tables) -> list[dict]:
    tax = dataparallel_tax_of(t)
    if tax is None or tax.share < DP_TAX_WARN or not worth_time(tax.ms, tax.step_ms):
        return []
    parts = ", ".join(f"{p} {ms:.2f} ms" for p, ms in tax.by_phase_ms.items())
    return [finding("dataparallel_tax", critical_share_or("warning", tax.share), None,
                    f"scatter, replicate and gather take {tax.share:.0%} of the step",
                    f"per step past the first: {parts} of a {tax.step_ms:.2f} ms mean step; it "
                    f"{cost_text(tax.ms, t.later_step_count)}",
                    "This is work only DataParallel does: DistributedDataParallel runs one process per GPU with the "
                    "model resident there, so it has no replicate and no gather, and overlaps the gradient all-reduce "
                    "with backward. A larger batch per step also spreads this cost.", tax.share, "share")]


@dataclass(frozen=True)
class SplitCost:
    """What the batch's split cost a run, per step past the first (split_cost): the apply of a device with the
    biggest chunk, which the step waits for, and the shares of the devices' time in it the split leaves unused
    (records.split_shares of the step's chunks, the pre-flight check's figures of a split)."""

    apply_ms: float  # mean apply of a device with the biggest chunk (the slower of several)
    uneven: float  # mean share of the devices' time the chunks given leave unused beside the biggest
    idle: float  # mean share of the devices' time the devices given none leave unused
    uneven_ms: float  # mean ms a step: apply_ms x uneven, step by step
    idle_ms: float  # mean ms a step: apply_ms x idle, step by step


def split_cost(t: Tables) -> SplitCost | None:
    """What uneven chunks and idle devices cost each step past the first: the apply of a device with the step's
    biggest chunk (chunks of every forward call that scattered a batch summed) times records.split_shares of the
    step's chunks over the devices the run spreads its batch over (RunModel.spread: not the host an output_device -1
    gathers onto); None where no step past the first has both chunks and apply times."""
    chunked = t.memory.dropna(subset=["chunk_size"])
    chunks = chunked[chunked["step"] != t.first_step].groupby(["step", "device"])["chunk_size"].sum().unstack("device")
    apply = per_step(t, ["apply"])
    steps = chunks.index.intersection(apply.index)
    if steps.empty:
        return None
    chunks, apply = chunks.loc[steps], apply.loc[steps]
    biggest = chunks.eq(chunks.max(axis=1), axis=0).reindex(columns=apply.columns, fill_value=False)
    waited_ms = apply.where(biggest).max(axis=1)
    n = len(t.model.spread)
    # split_shares once per distinct split (a run has one or two), not once per step: 2,000 steps took 0.1 s at close
    filled = chunks.fillna(0.0)
    devices = list(filled.columns)
    splits = filled.drop_duplicates().reset_index(drop=True)
    splits[["uneven", "idle"]] = [split_shares(list(row), n) for row in splits[devices].itertuples(index=False)]
    shares = filled.merge(splits, on=devices, how="left")[["uneven", "idle"]].set_axis(filled.index)
    keep = waited_ms.notna()
    if not keep.any():
        return None
    waited_ms, shares = waited_ms[keep], shares[keep]
    return SplitCost(apply_ms=float(waited_ms.mean()), uneven=float(shares["uneven"].mean()),
                     idle=float(shares["idle"].mean()), uneven_ms=float((waited_ms * shares["uneven"]).mean()),
                     idle_ms=float((waited_ms * shares["idle"]).mean()))


def uneven_chunks(t: Tables) -> list[dict]:
    """Steps whose chunks differ in size, and devices that never got one, each where what it costs (split_cost)
    clears the floors. Only the forward calls that scattered a batch count (a whole-batch loss call has no chunk)."""
    chunked = t.memory.dropna(subset=["chunk_size"])
    cost, step_ms = split_cost(t), t.median_step_ms
    if chunked.empty or cost is None:
        return []
    findings = []
    n, later = len(t.model.spread), t.later_step_count
    waited = (f"a device with the biggest chunk applies {cost.apply_ms:.2f} ms a step past the first, which every "
              "step waits for")
    calls = chunked.groupby(["step", "call"])["chunk_size"].agg(["min", "max"])
    per_step_sizes = calls.groupby("step").agg(min=("min", "min"), max=("max", "max"))
    uneven = per_step_sizes[per_step_sizes["min"] != per_step_sizes["max"]]
    share = len(uneven) / len(per_step_sizes)
    if share > UNEVEN_STEPS_SHARE and worth_time(cost.uneven_ms, step_ms):
        step = uneven.index[0]
        first_call = chunked[chunked["step"] == step]["call"].min()
        order = {d: i for i, d in enumerate(t.model.devices)}
        sizes = [int(c) for c in chunked[(chunked["step"] == step) & (chunked["call"] == first_call)]
                 .sort_values("device", key=lambda s: s.map(order))["chunk_size"]]
        spread = (uneven["max"] - uneven["min"]) / uneven["min"]  # over the smallest: "bigger than the smallest"
        costs = cost.uneven_ms / step_ms  # the finding's value: the share of the step the uneven split costs
        findings.append(finding("uneven_chunks", critical_or(uneven_severity(sizes, n), cost.uneven_ms, step_ms),
                                None, f"chunks were uneven in {share:.0%} of steps, costing {costs:.0%} of the step",
                                f"{len(uneven)} of {len(per_step_sizes)} steps; e.g. step {step}: chunks {sizes}; the "
                                f"largest chunk is {spread.mean():.0%} bigger than the smallest on average; {waited}; "
                                f"in that time the uneven chunks leave {cost.uneven:.0%} of the devices' time unused "
                                "(no split of the same samples gives a smaller biggest chunk): the uneven split "
                                f"{cost_text(cost.uneven_ms, later)} ({costs:.0%} of the {MEDIAN_STEP})",
                                f"torch.chunk splits the batch; use a batch size that {n} divides "
                                "evenly (dpprof check --batch-size N shows the split).", costs, "share"))
    idle = list(t.model.idle)
    if idle and worth_time(cost.idle_ms, step_ms):
        costs = cost.idle_ms / step_ms
        findings.append(finding("idle_devices", critical_or(idle_severity(len(idle), n), cost.idle_ms, step_ms),
                                idle[0], f"{len(idle)} device(s) never got a chunk, costing {costs:.0%} of the step",
                                f"devices {', '.join(idle)} of {n} did no work in any step: the run used "
                                f"{n - len(idle)} of its {n} devices; {waited}; in that time the idle devices leave "
                                f"{cost.idle:.0%} of the {n} devices' time unused: leaving them idle "
                                f"{cost_text(cost.idle_ms, later)} ({costs:.0%} of the {MEDIAN_STEP})",
                                "The batch is smaller than the number of devices times the chunk torch.chunk makes; "
                                "raise the batch size or use fewer devices.", costs, "share"))
    elif not idle and worth_time(cost.idle_ms, step_ms):
        findings += _idle_in_some_steps(t, chunked, cost, waited)
    return findings


def _idle_in_some_steps(t: Tables, chunked: pd.DataFrame, cost: SplitCost, waited: str) -> list[dict]:
    """The idle_devices finding of devices that got no chunk in some steps past the first only (a batch of 4 on 3
    devices splits 2, 2 and leaves the third idle in those steps, a batch of 6 gives it 2): what split_cost counts
    of those steps, said as the devices and steps it comes from."""
    later = chunked[chunked["step"] != t.first_step]
    given = later.groupby("step")["device"].agg(set)
    short = {d: int(sum(d not in s for s in given)) for d in t.model.spread}
    short = {d: k for d, k in short.items() if k}
    if not short:
        return []
    n, step_ms = len(t.model.spread), t.median_step_ms
    most_idle = max(n - len(s) for s in given)
    step = next(s for s, got in given.items() if len(got) < n)
    order = {d: i for i, d in enumerate(t.model.devices)}
    first_call = later[later["step"] == step]["call"].min()
    sizes = [int(c) for c in later[(later["step"] == step) & (later["call"] == first_call)]
             .sort_values("device", key=lambda s: s.map(order))["chunk_size"]]
    costs = cost.idle_ms / step_ms
    which = ", ".join(f"{d} in {k} of {len(given)}" for d, k in short.items())
    return [finding("idle_devices", critical_or(idle_severity(most_idle, n), cost.idle_ms, step_ms), next(iter(short)),
                    f"{len(short)} device(s) got no chunk in some steps, costing {costs:.0%} of the step",
                    f"steps past the first in which a device did no work: {which}; e.g. step {step}: chunks {sizes} "
                    f"on {n} devices; {waited}; in that time the devices idle in the step leave "
                    f"{cost.idle:.0%} of the {n} devices' time unused on average: leaving them idle "
                    f"{cost_text(cost.idle_ms, t.later_step_count)} "
                    f"({costs:.0%} of the {MEDIAN_STEP})",
                    f"torch.chunk gives every device ceil(batch / {n}) samples until the batch runs out, so some "
                    f"batch sizes leave devices with nothing; use batch sizes that {n} divides evenly (dpprof check "
                    "--batch-size N shows the split), or drop the short batches (drop_last=True).", costs, "share")]


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
    working = len([d for d in t.model.spread if d not in t.model.idle])
    summed = (f"; it includes summing every replica's gradients onto {device}" if working > 1 else
              f" (one device: no replica's gradients to sum onto {device})")
    return [finding("backward_share", "info", device, f"backward takes {share:.0%} of the step",
                    f"mean backward {backward_ms:.2f} ms of a {steps.mean():.2f} ms mean step past the first{summed}",
                    "Expected for small models; the reduction onto one device grows with devices and model size, "
                    "which DistributedDataParallel spreads across devices and overlaps with backward." if working > 1
                    else "Expected for small models on one device: its backward is the model's own.", share, "share")]
