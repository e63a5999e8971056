"""The recorded run's figures the advisor's model starts from, read once (torch-free).

**The typical step.** Steps past the first (its one-time costs: first calls, allocations), at the run's most
common batch size, whose time lies between the 25th and 75th percentile: each phase is averaged over these
steps, so the parts add up exactly to their mean step, which stands for the median step without the stalls a
shared machine adds. A long run (read from its aggregates) uses the steps whose detail stands for the run
(RunModel.sampled_steps_sql, applied in dpprof.store.advisor_rows). A run that evaluates between its training steps
(forwards alone, under no_grad: steps with no backward) is read from its training steps alone, the steps the advisor
predicts: the typical step, the median step and its interval, the spread of applies and the stalls
(queries.training_steps_of's rule, over the steps whose detail stands for the run).

**Memory** is what dpprof accounts to each device in its peak step, split into what scales with the batch
(its input chunk, outputs, saved activations, gathered outputs, the loss's tensors) and what does not (weights,
buffers), and the CUDA allocator's peak where the run recorded it.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from dpprof.advise import NotAdvisable
from dpprof.findings.steps import OUTLIER_STEP_RATIO, bigger_batches, stalls, thinned_kinds
from dpprof.records import even_batch_sizes
from dpprof.store import advisor_rows, finding_rows, queries
from dpprof.store.reader import StoredRun, effective_status
from dpprof.workload_names import WORKLOAD_NAMES

__all__ = ["MIN_STEPS", "Measured", "DeviceMemory", "measure", "chunk_sizes"]

# As the findings (dpprof.findings): the first step carries one-time costs, so a run needs at least two more
# to say anything about a typical step.
MIN_STEPS = 3
TYPICAL_QUANTILES = (0.25, 0.75)  # the middle half of the steps: stalls from other jobs left out
BOOTSTRAP_RESAMPLES = 400  # enough for a 90% interval of the median to settle within a percent
MEDIAN_INTERVAL = (0.05, 0.95)  # the 90% interval of the median step, by resampling the steps


def chunk_sizes(batch: int, devices: int) -> list[int]:
    """torch.chunk's split of ``batch`` samples over ``devices``: chunks of ceil(batch / devices), the last
    smaller; fewer chunks than devices when the batch is small (10 on 8 -> five chunks of 2)."""
    if batch <= 0 or devices <= 0:
        return []
    size = -(-batch // devices)
    full, rest = divmod(batch, size)
    return [size] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class DeviceMemory:
    """What dpprof accounts to one device in its peak step, by what it scales with."""

    device: str
    chunk: int  # samples of the model's input chunk in that step
    model_bytes: int  # the model call's input chunk, outputs and saved activations: scale with the chunk
    fixed_bytes: int  # weights and buffers (a replica's copies on the other devices): do not scale
    gathered_bytes: int  # gathered outputs (the output device): scale with the global batch
    loss_bytes: int  # the loss's targets, output and saved tensors on this device
    loss_scales_with: str  # "batch": a whole-batch loss on the output device; "chunk": the balanced criterion's share
    held_bytes: int  # all of it: the peak held
    allocator_peak_bytes: int | None  # the CUDA allocator's peak allocated; None on CPU workers


@dataclass(frozen=True)
class Measured:
    """One recorded DataParallel run, in the terms of the advisor's model (times are ms per typical step)."""

    run_id: str
    name: str
    kind: str  # "dataparallel" or "balanced"
    backend: str  # "cpu" (CPU workers) or "cuda"
    devices: tuple[str, ...]  # in device_ids order; the first is the output device
    batch_size: int  # the typical step's global batch
    chunks: tuple[int, ...]  # each device's chunk in the typical step (torch.chunk's split)
    steps: int  # steps in the run
    typical_steps: int  # steps the parts are averaged over
    step_ms: float  # the median step (dpprof's one definition: every recorded step; the training steps' where the run
    # evaluates between them: queries.kind_medians)
    typical_step_ms: float  # the mean of the typical steps: what the parts add up to
    median_interval: tuple[float, float]  # the 90% interval of the median step over the median, by resampling
    step_quartiles: tuple[float, float]  # the 25th and 75th percentile of the steps past the first, over the median
    gap_ms: float  # the median time between one step's end and the next one's start: loading the batch, the loop
    parts_ms: dict[str, float]  # scatter, replicate, apply (one device), parallel_apply, gather, loss, reduce, backward,
    # rest: the typical step's, adding up to it
    apply_ms: dict[str, float]  # each device's apply of the model (call 0)
    loss_apply_ms: dict[str, float]  # each device's apply of the balanced criterion (its share of the loss)
    loss_parts_ms: dict[str, float]  # the balanced criterion's own scatter, replicate, parallel_apply
    fixed_apply_ms: float  # the part of an apply that does not scale with its chunk (per chunk)
    fixed_apply_source: str  # how fixed_apply_ms was found, in words
    threads: int  # intra-op threads of the recording process
    threads_source: str
    cores: int
    memory: dict[str, DeviceMemory]
    param_bytes: int  # the model's weights (its gradients are as large)
    input_bytes_per_sample: float
    output_bytes_per_sample: float
    target_bytes_per_sample: float
    total_memory_bytes: dict[str, int]  # a GPU's memory (devices table); empty on CPU workers
    workload: str | None
    workload_args: dict[str, Any] = field(default_factory=dict)
    source: str = "script"  # "builtin" (dpprof profile WORKLOAD), "model" (dpprof profile --model), "script"
    # each device's apply in each step past the first over that device's mean apply, pooled over the devices and
    # clipped to their 5th-95th percentiles (a stall is not the spread of one rank's step): how much one step's
    # compute moves from the next, by its batch (lengths, content) and the machine
    apply_ratios: tuple[float, ...] = ()
    # the steps past the first: the fastest, 25th and 75th percentile and slowest (ms), said where their spread is
    # too wide to predict from
    step_spread_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # the stall finding's sentence where the run's steps stall (dpprof.findings.steps.stalls), said before any
    # prediction; None where they do not
    stall_note: str | None = None
    incomplete_note: str | None = None  # that the run did not finish (its status, the steps it recorded)
    # the run evaluates between its training steps (steps with no backward): the figures above are its training steps'
    training_only: bool = False

    @property
    def n(self) -> int:
        return len(self.devices)

    @property
    def output_device(self) -> str:
        return self.devices[0]


def _typical(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps past the first at the most common batch size, in the middle half by time."""
    later = steps[steps["step"] > steps["step"].min()]
    if later["batch_size"].notna().any():
        mode = later["batch_size"].mode()
        later = later[later["batch_size"] == mode.max()]
    lo, hi = later["duration_ms"].quantile(list(TYPICAL_QUANTILES))
    middle = later[(later["duration_ms"] >= lo) & (later["duration_ms"] <= hi)]
    return middle if len(middle) >= 2 else later


def _median_interval(durations: list[float]) -> tuple[float, float]:
    """The 90% interval of the median of ``durations`` over the median, by resampling them (seeded: the same
    run gives the same interval)."""
    med = statistics.median(durations)
    if len(durations) < 2 or med <= 0:
        return 1.0, 1.0
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(durations, k=len(durations))) for _ in range(BOOTSTRAP_RESAMPLES))
    lo = meds[int(MEDIAN_INTERVAL[0] * (len(meds) - 1))]
    hi = meds[int(MEDIAN_INTERVAL[1] * (len(meds) - 1))]
    return lo / med, hi / med


def _refuse(run: StoredRun) -> None:
    """NotAdvisable, in one line, for a run the model cannot start from."""
    model = run.model
    if model.kind == "empty":
        reason = (model.empty_reason or "the run recorded no steps").rstrip(".")
        raise NotAdvisable(f"run {run.id} has nothing to predict from: {reason[:1].lower()}{reason[1:]}")
    if model.imported:
        raise NotAdvisable(f"run {run.id} is an imported torch.profiler trace: it holds no dpprof accounting of what "
                           "each device computes per sample and holds to predict from; record the training with "
                           "dpprof (dpprof run or dpprof profile) and advise on that run")
    if model.kind not in ("dataparallel", "balanced"):
        what = {"ddp": "a DistributedDataParallel run", "fsdp": "an FSDP run"}.get(
            model.kind, f"not a DataParallel run ({model.title})")
        raise NotAdvisable(f"run {run.id} is {what}: the advisor predicts other set-ups from a DataParallel run; "
                           "record the model with DataParallel (dpprof profile, or dpprof run on a script that uses "
                           "it) and advise on that run")
    if model.steps < MIN_STEPS:
        raise NotAdvisable(f"run {run.id} has {model.steps} step(s): the advisor needs at least {MIN_STEPS} (the "
                           "first step carries one-time costs, and a typical step needs two more)")
    if model.backend not in ("cpu", "cuda"):
        raise NotAdvisable(f"run {run.id} ran on no device ({model.backend}): DataParallel without device_ids")
    if model.spread != model.devices:
        raise NotAdvisable(f"run {run.id} gathered its outputs onto the host (output_device=-1): the advisor predicts "
                           "from runs that gather onto one of their devices; record it without output_device=-1")
    if model.idle:  # DataParallel replicates onto the devices that got a chunk only: no set-up the model knows
        n = len(model.devices)
        batches = pd.to_numeric(advisor_rows.step_batch_maxima(run).iloc[1:], errors="coerce").dropna()
        # torch.chunk's chunks of ceil(batch / n) run out before the last devices, also where the batch is n or more
        # (4 on 3: 2, 2): the batch said with its split, and the batches n divides evenly beside it
        split = ""
        even = f"a batch {n} divides evenly"
        if len(batches):
            batch = int(batches.mode().max())
            split = f": torch.chunk splits its batch of {batch} into {chunk_sizes(batch, n)} over its {n} devices"
            even += f" ({' or '.join(map(str, even_batch_sizes(batch, n)))})"
        raise NotAdvisable(f"run {run.id} gave no chunk to {', '.join(model.idle)}{split}; the advisor predicts from "
                           f"runs whose every device works: record it with {even}")


def measure(run: StoredRun) -> Measured:
    """The run's typical step, its parts, its chunks and its memory, for dpprof.advise.predict.

    Raises:
        NotAdvisable: a DDP or FSDP run, an imported trace, an empty run or one of fewer than MIN_STEPS steps, or a step
            the model does not cover (several DataParallel forward calls); the message says why in one line.
    """
    _refuse(run)
    model = run.model
    steps = advisor_rows.sampled_steps(run)
    durations = advisor_rows.durations_past_first(run)
    # evaluation between training steps (forwards alone, no backward): the advisor predicts the training steps
    training = queries.training_steps_of(advisor_rows.trained_steps(run), steps["step"])
    if training is not None:
        steps = steps[steps["step"].isin(training)]
        durations = durations[durations.index.isin(training)]
    if len(steps) < MIN_STEPS or len(durations) < MIN_STEPS - 1:
        which = (f"{len(steps)} training step(s) beside its evaluation steps" if training is not None
                 else f"the detail of {len(steps)} step(s)")
        raise NotAdvisable(f"run {run.id} keeps {which}: the advisor needs {MIN_STEPS}")
    typical = _typical(steps)
    ids = tuple(int(s) for s in typical["step"])
    phases = advisor_rows.phases_of_steps(run, ids)
    if phases.empty:
        raise NotAdvisable(f"run {run.id} has no phases in its typical steps: nothing to predict from")
    calls = sorted(int(c) for c in phases["call"].unique())
    criterion_call = None
    for c in calls[1:]:
        names = set(phases.loc[phases["call"] == c, "phase"])
        if names & {"loss", "reduce"}:
            criterion_call = c
        elif names:
            raise NotAdvisable(f"run {run.id} runs DataParallel {len(calls)} times a step: the advisor models one "
                               "DataParallel forward per step and its loss")
    per_step = typical["duration_ms"]
    count = len(ids)

    def mean(phase: str, call: int | None = 0, device: str | None = None) -> float:
        rows = phases[phases["phase"] == phase]
        if call is not None:
            rows = rows[rows["call"] == call]
        if device is not None:
            rows = rows[rows["device"] == device]
        return float(rows["duration_ms"].sum()) / count

    devices = tuple(d for d in model.devices if d not in model.idle)
    parts = {p: mean(p) for p in ("scatter", "replicate", "parallel_apply", "gather")}
    # one device: the module runs on the caller, its apply a part of the step; else inside parallel_apply
    parts["apply"] = mean("apply") if not parts["parallel_apply"] else 0.0
    loss_parts = {}
    if criterion_call is not None and model.kind == "balanced":
        loss_parts = {p: mean(p, criterion_call) for p in ("scatter", "replicate", "parallel_apply")}
        # on one device the criterion runs whole on the caller: its "loss" phase, no parallel_apply around it
        parts["loss"] = sum(loss_parts.values()) + mean("loss", criterion_call)
        parts["reduce"] = mean("reduce", criterion_call)
    else:
        parts["loss"] = mean("loss", criterion_call) if criterion_call is not None else 0.0
        parts["reduce"] = 0.0
    parts["backward"] = mean("backward", None)
    typical_ms = float(per_step.mean())
    parts["rest"] = typical_ms - sum(parts.values())
    apply_ms = {d: mean("apply", 0, d) for d in devices}
    loss_apply = ({d: mean("apply", criterion_call, d) + mean("loss", criterion_call, d) for d in devices}
                  if loss_parts else {})

    chunks_seen = advisor_rows.model_chunks_of_steps(run, ids)
    batch = int(typical["batch_size"].max()) if typical["batch_size"].notna().any() else 0
    by_device = chunks_seen.groupby("device")["chunk_size"].median()
    chunks = tuple(int(by_device.get(d, 0) or 0) for d in devices)
    if not batch or sum(chunks) != batch:
        split = chunk_sizes(batch, len(devices))
        chunks = tuple(split + [0] * (len(devices) - len(split))) if batch else chunks
    fixed, fixed_source = _fixed_apply_ms(run, devices, training)
    ratios = _apply_ratios(run, training)
    threads, threads_source, cores = _threads(run)
    memory = _memory(run, devices, batch, model.kind)
    first = memory[devices[0]]
    inputs = advisor_rows.model_call_bytes(run, ids)
    samples = float(inputs["samples"].sum() or 0)
    targets = (advisor_rows.call_input_bytes(run, criterion_call, ids) if criterion_call is not None
               else pd.Series([0]))
    totals = run.table("devices")
    total = {str(r["device"]): int(r["total_memory_bytes"]) for _, r in totals.iterrows()
             if pd.notna(r.get("total_memory_bytes")) and r.get("kind") == "cuda"}
    workload = run.meta.get("workload")
    args = run.meta.get("workload_args") or {}
    source = ("builtin" if workload in WORKLOAD_NAMES and "steps" in args else
              "model" if "input_shape" in args and "steps" in args else "script")
    return Measured(
        run_id=run.id, name=str(run.meta.get("name") or run.id), kind=model.kind, backend=str(model.backend),
        devices=devices, batch_size=batch, chunks=chunks, steps=model.steps, typical_steps=count,
        step_ms=float(_median_ms(run, training) or typical_ms), typical_step_ms=typical_ms,
        median_interval=_median_interval([float(d) for d in durations]),
        gap_ms=_gap_ms(run),
        step_quartiles=(float(durations.quantile(0.25) / durations.median()),
                        float(durations.quantile(0.75) / durations.median())), parts_ms=parts, apply_ms=apply_ms,
        loss_apply_ms=loss_apply, loss_parts_ms=loss_parts, fixed_apply_ms=fixed, fixed_apply_source=fixed_source,
        threads=threads, threads_source=threads_source, cores=cores, memory=memory,
        param_bytes=int(first.fixed_bytes),
        input_bytes_per_sample=float(inputs["input_bytes"].sum() or 0) / samples if samples else 0.0,
        output_bytes_per_sample=float(inputs["output_bytes"].sum() or 0) / samples if samples else 0.0,
        target_bytes_per_sample=float(targets.sum() or 0) / (batch * count) if batch else 0.0,
        total_memory_bytes=total, workload=workload, workload_args=dict(args), source=source, apply_ratios=ratios,
        step_spread_ms=tuple(float(q) for q in durations.quantile([0, 0.25, 0.75, 1])),  # type: ignore[arg-type]
        stall_note=_stall_note(run, training), incomplete_note=_incomplete_note(run, model.steps),
        training_only=training is not None)


def _median_ms(run: StoredRun, training: set[int] | None) -> float | None:
    """The median step, of the training steps where the run evaluates between them (``training``)."""
    if training is None:
        return queries.median_step_ms(run)
    return (queries.kind_medians(run) or {}).get("training")


def _incomplete_note(run: StoredRun, steps: int) -> str | None:
    """That the run did not finish, in a sentence said before the predictions; None for a finished run."""
    status = effective_status(run.meta)
    if status == "finished":
        return None
    asked = (run.meta.get("workload_args") or {}).get("steps")
    of = f" of the {int(asked):,} asked for" if asked else ""
    state = "is still recording" if status == "running" else f"is incomplete (status {status})"
    return (f"Run {run.id} {state}: it recorded {steps:,} steps{of}. The predictions start from the steps it "
            f"recorded, and each command runs as many.")


def _stall_note(run: StoredRun, training: set[int] | None = None) -> str | None:
    """The stall finding's rule (dpprof.findings.steps.stalls) over every step past the first (the ``training`` steps
    alone where the run evaluates between them: a training step is no stall for being longer than an evaluation
    step; a thinned run's every step whose detail was thinned beside them, where the slower kind's median makes it a
    stall whatever its kind), in a sentence said before the predictions; None where the steps do not stall. Slow steps that carried a bigger batch than the
    median step's are put down to their batch, as the finding puts them (dpprof.findings.steps.bigger_batches).

    Stalls do not stop a prediction: a stall is a step over OUTLIER_STEP_RATIO x the median, so stalls are always
    fewer than half the steps; the median step is not moved by them and the typical step the parts come from
    (the middle half) never holds one. What they say is that the machine was shared while the run recorded.
    """
    per, batches = advisor_rows.step_maxima(run).iloc[1:], advisor_rows.step_batch_maxima(run).iloc[1:]
    kind, kinds, medians = "", None, None
    every_kind = queries.kind_medians(run) if run.model.thinned else None
    of_steps: int | None = None
    if every_kind is not None:
        # a thinned run that evaluates between its training steps: a step's kind is known where its detail was kept
        # (training or, without a backward, not); a thinned step's is not, and it is judged against the larger of
        # the kinds' medians (every step's, the writer's sketches), over which it is a stall whatever its kind (one of
        # an evaluation step, slower than that, is counted with the training steps' as their kinds are not told apart)
        kinds, medians = thinned_kinds(per.index, finding_rows.kept_steps_trained(run), every_kind)
        judged = kinds != "evaluation"
        per, batches, kinds = per[judged], batches[judged], kinds[judged]
        del medians["evaluation"]
        rate = queries.throughput(run)  # the training steps past the first, counted from every step's blocks
        of_steps = rate.steps - rate.evaluation_steps - rate.raised_steps if rate is not None else None
        kind = "training "
    elif training is not None:
        per, batches, kind = per[per.index.isin(training)], batches[batches.index.isin(training)], "training "
    found = stalls(per, kinds, medians)
    if found is None:
        return None
    if of_steps is not None:
        found = replace(found, steps=of_steps)
    slow = len(found.slow_ms)
    worst = ", ".join(f"{int(s)} ({ms:,.0f} ms)" for s, ms in found.slow_ms.head(3).items()) + _more(slow)
    bigger, median_batch = bigger_batches(batches, found.slow_ms.index)
    if not bigger:
        return (f"{slow} of {found.steps} {kind}steps stalled (over {OUTLIER_STEP_RATIO:g}x the median {kind}step of "
                f"{found.median_ms:,.2f} ms: steps {worst}; {found.share:.0%} of the run's step time): something else "
                "ran on this machine. The predictions start from the median and the typical step, which leave the "
                "stalls out, and hold for a machine as quiet as the run's other steps.")
    listed = ", ".join(f"{s} ({b:,} samples)" for s, b in list(bigger.items())[:3]) + _more(len(bigger))
    took = (f"{slow} of {found.steps} {kind}steps took over {OUTLIER_STEP_RATIO:g}x the median {kind}step of "
            f"{found.median_ms:,.2f} ms (steps {worst}; {found.share:.0%} of the run's step time)")
    bigger_words = (f"a bigger batch than the median {kind}step's {median_batch:,g} samples (steps {listed}): their "
                    "time follows their batch (batches of varying size), not a stall")
    if len(bigger) == slow:
        return (f"{took}, each with {bigger_words}. The predictions start from the median and the typical step, of the "
                "run's most common batch, which leave them out.")
    return (f"{took}: {len(bigger)} of them had {bigger_words}; the other {slow - len(bigger)} stalled: something else ran "
            "on this machine. The predictions start from the median and the typical step, of the run's most common "
            "batch, which leave them out, and hold for a machine as quiet as the run's other steps.")


def _more(listed: int, shown: int = 3) -> str:
    return f" and {listed - shown} more" if listed > shown else ""


RATIO_CLIP = (0.05, 0.95)  # apply_ratios' percentiles kept: a stall of the machine is not a rank's spread


def _apply_ratios(run: StoredRun, training: set[int] | None = None) -> tuple[float, ...]:
    """Each device's model apply (call 0) in each step past the first (each ``training`` step, where the run evaluates
    between them) over that device's mean, pooled, clipped to RATIO_CLIP's percentiles; empty where the run has fewer
    than MIN_STEPS such steps."""
    rows = advisor_rows.sampled_model_applies(run)
    if training is not None:
        rows = rows[rows["step"].isin(training)]
    if len(rows) < MIN_STEPS:
        return ()
    means = rows.groupby("device")["duration_ms"].transform("mean")
    ratios = (rows["duration_ms"] / means)[means > 0]
    lo, hi = ratios.quantile(list(RATIO_CLIP))
    return tuple(float(r) for r in ratios.clip(lo, hi))


def _gap_ms(run: StoredRun) -> float:
    """The median gap between consecutive steps (the next start less this one's end), the first step left out."""
    steps = advisor_rows.step_spans(run)
    steps = steps[steps["step"] > steps["step"].min()]
    gaps = (steps["start_ms"].shift(-1) - steps["start_ms"] - steps["duration_ms"])[steps["step"].diff().shift(-1) == 1]
    gaps = gaps.dropna().clip(lower=0)
    return float(gaps.median()) if len(gaps) else 0.0


# Fewer steps than this at a second chunk size do not separate a per-chunk cost from a per-sample one.
MIN_STEPS_PER_CHUNK_SIZE = 3


def _fixed_apply_ms(run: StoredRun, devices: tuple[str, ...], training: set[int] | None = None) -> tuple[float, str]:
    """The per-chunk part of an apply: the intercept of one device's apply time against its chunk size, where
    that device's chunks came in at least two sizes (an epoch's last, smaller batch), the median over such
    devices; else 0 (every apply scales with its chunk). Of the ``training`` steps alone where the run evaluates between
    them: an evaluation's apply under no_grad is no training apply of another chunk size.

    Only one device's own chunks are compared: across devices the chunk sizes differ by a sample or two (torch.chunk
    gives the last device fewer) while the samples themselves differ far more (a sorted batch puts its longest
    sequences on the last device), so a line through different devices' applies measures where a chunk sits in
    the batch, not what a chunk costs, and can call most of the compute "per chunk": batch size then moves nothing.
    """
    rows = advisor_rows.model_applies_with_chunks(run)
    if training is not None:
        rows = rows[rows["step"].isin(training)]
    rows = rows.dropna(subset=["chunk"])
    rows = rows[rows["device"].isin(devices)]
    # per device and chunk size, the median apply (robust to stalls) over the steps that had it
    per = rows.groupby(["device", "chunk"])["ms"].agg(["median", "count"])
    per = per[per["count"] >= MIN_STEPS_PER_CHUNK_SIZE]
    fits: list[tuple[str, float, list[tuple[float, float]]]] = []
    for device, group in per.groupby(level="device"):
        if len(group) < 2:
            continue
        xs = [float(c) for c in group.index.get_level_values("chunk")]
        ys = [float(y) for y in group["median"]]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
        fits.append((str(device), min(max(0.0, my - slope * mx), min(ys)), list(zip(xs, ys))))
    if not fits:
        return 0.0, ("each device's chunks had one size, so an apply is taken to scale with its chunk (no per-chunk "
                     "part; the hand-off to a worker is measured apart)")
    fixed = statistics.median(f for _, f, _ in fits)
    device, _, points = fits[0]
    shown = ", ".join(f"{int(x)} samples {y:.3f} ms" for x, y in points)
    return fixed, (f"from each device's own chunks of 2 sizes or more ({len(fits)} device(s); {device}'s median "
                   f"apply: {shown}): {fixed:.3f} ms per chunk")


def _threads(run: StoredRun) -> tuple[int, str, int]:
    devices = run.table("devices")
    cores = int(devices["cores"].dropna().max()) if "cores" in devices and devices["cores"].notna().any() else 1
    recorded = (run.meta.get("workload_args") or {}).get("threads")
    if recorded:
        return int(recorded), "recorded with the run", cores
    return cores, "not recorded: taken as the cores (torch's default)", cores


def _memory(run: StoredRun, devices: tuple[str, ...], batch: int, kind: str) -> dict[str, DeviceMemory]:
    peaks = queries.memory_peaks(run, detail=False)
    out = {}
    for device in devices:
        row = peaks[peaks["device"] == device]
        if row.empty or pd.isna(row["peak_step"].iloc[0]):
            raise NotAdvisable(f"run {run.id} has no memory records for {device}: nothing to predict memory from")
        step = int(row["peak_step"].iloc[0])
        calls = advisor_rows.memory_calls(run, device, step)
        model_rows = calls[calls["call"] == 0]
        other = calls[calls["call"] != 0]
        alloc = row["peak_allocated_bytes"].iloc[0]
        out[device] = DeviceMemory(
            device=device, chunk=int(model_rows["chunk_size"].sum() or 0),
            model_bytes=int((model_rows["input_bytes"] + model_rows["output_bytes"] + model_rows["activation_bytes"]).sum()),
            fixed_bytes=int((calls["param_bytes"] + calls["buffer_bytes"]).sum()),
            gathered_bytes=int(calls["gathered_bytes"].sum()),
            loss_bytes=int((other["input_bytes"] + other["output_bytes"] + other["activation_bytes"]).sum()),
            loss_scales_with="chunk" if kind == "balanced" else "batch",
            held_bytes=int(row["peak_held_bytes"].iloc[0]),
            allocator_peak_bytes=None if pd.isna(alloc) else int(alloc))
    return out
