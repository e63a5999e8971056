"""The advisor's arithmetic: from one recorded DataParallel run (dpprof.advise.measured) and this machine's
calibration (dpprof.advise.calibration_cache), each scenario's step time with its parts and interval, and each
device's peak held memory. Torch-free; every figure here can be checked by hand (docs/advise.md walks one run).

**Level from the run, shape from the machine.** Every part starts from what the run measured in its typical
step; what changes with the set-up is added on top:

- compute (each device's apply, backward) scales with the samples it gets, device by device along the batch
  (a sorted batch keeps its long samples at the end), less a per-chunk part where the run shows one;
- DataParallel's own machinery (scatter, replicate, the dispatch around parallel_apply, gather, the backward's
  per-replica work, the recording's bookkeeping outside the phases, the balanced criterion's scatter, replicate
  and reduce) changes by what the calibration measured for a model with no compute on k workers against n, plus
  a copy of the weights per replica;
- CPU workers share the cores this job gets (the calibration measures them: the host's on an idle machine, fewer
  where other jobs run): k workers of t threads each on C cores run at most C threads' worth at a time, so each
  apply takes max(1, k t / C) times its time alone, and the recorded times are taken at that speed too;
- DDP ranks (``dpprof profile --ddp``: one process, one intra-op thread each) run their forward, loss and
  backward on their own chunk, then all-reduce the gradients bucket by bucket (each as long as a real DDP run's
  wait for one small bucket, plus its bytes at the calibrated gloo rate), the buckets launched as backward reaches
  them; the step waits for the slowest rank, and since each rank has its own batch, for the slowest of n ranks'
  steps as they move from step to step: the largest of n draws of the recorded applies' spread about their mean.

**Intervals.** The widest of: the middle half of the recorded steps (the machine's noise while it ran), the
recorded median's 90% interval widened for comparing two runs' medians (x sqrt 2), and RUN_TO_RUN_SHARE (how far
two runs of one set-up land apart on a shared machine); scaled to the prediction; plus EXTRAPOLATION_SHARE of the
change the prediction makes from the recorded step (what the model assumed rather than measured).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpprof.advise import NotAdvisable
from dpprof.advise.calibration_cache import Calibration
from dpprof.advise.commands import no_command, profile_for
from dpprof.advise.compute import ComputeProbe, layout_key
from dpprof.advise.measured import Measured, chunk_sizes
from dpprof.loaders import said_in
from dpprof.records import PHASE_ORDER
from dpprof.stepmodel import PHASE_WORDS
from dpprof.units import mib, plural

if TYPE_CHECKING:
    from dpprof.launch import Profile

__all__ = ["Scenario", "Advice", "advise", "faster_than_recorded", "EXTRAPOLATION_SHARE", "MAX_INTERVAL_RATIO",
           "RUN_TO_RUN_SHARE",
           "DDP_FIRST_BUCKET_BYTES", "DDP_BUCKET_BYTES",
           "PART_ORDER"]

# The share of a prediction's change from the recorded step that its interval allows for: the per-sample split
# of compute, the cores model and DDP's overlap are assumptions, not measurements of the scenario (the README's
# table of predicted against measured shows how far they were off).
EXTRAPOLATION_SHARE = 0.25
# How far the median of one run lands from another's of the same set-up minutes later on a machine shared with
# other jobs: a median of 15% over bench/advise.py's re-runs of the recorded set-ups (3 rounds, 5 workloads, the
# shared 2-core build machine, 2026-11-23). An interval is never narrower than this either side of its step.
RUN_TO_RUN_SHARE = 0.15
# An interval whose high end is over this many times its low end (or whose low end is 0) is no prediction: the
# set-ups the advisor weighs differ from the recorded one by a few times at most (half or twice the devices or the
# batch), so a range over 10x cannot order any two of them, and the figure in its middle is nothing to act on.
MAX_INTERVAL_RATIO = 10.0
# DistributedDataParallel's buckets (torch: dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25): the first
# bucket in backward order holds up to 1 MiB, the others up to 25 MiB
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20
# GPUs only (not checked against GPU runs: no GPU where this was built). Where a run recorded no transfer to measure
# the link by, a PCIe 3.0 x16 link's ~12 GB/s as a host measures it; and the latency of one NCCL all-reduce on one
# host, a few tens of microseconds in NCCL's own tests.
ASSUMED_LINK_MS_PER_MIB = 2**20 / 12e9 * 1e3
NCCL_LATENCY_MS = 0.03
# Parts of a step, in the order they run (records.PHASE_ORDER; data loading, the optimizer and the script's own
# collectives are in "rest"); each scenario's parts_ms add up to its step_ms.
PART_ORDER = (*(p for p in PHASE_ORDER if p not in ("data", "optimizer", "script_comm")), "rest")
PART_WORDS = {p: PHASE_WORDS.get(p, p) for p in PART_ORDER} | {"apply": "apply (one device, on the caller)",
                                                               "rest": "rest (optimizer, zero_grad, Python)"}


@dataclass
class Scenario:
    """One predicted set-up."""

    scenario: str  # "ddp" | "dataparallel" | "balanced"
    devices: int
    batch_size: int
    step_ms: float
    step_ms_low: float
    step_ms_high: float
    peak_bytes: dict[str, int]  # per device (ranks as rank:N): dpprof's accounting of what it holds
    parts_ms: dict[str, float]  # add up to step_ms
    label: str  # "DDP on 2 ranks (gloo)", "DataParallel on 3 CPU workers, batch 512"
    changes: list[str]  # what changes and why, with each part's predicted ms
    command: str | None  # the command that runs it for real; None where no_command says why not
    recorded: bool = False  # the recorded set-up itself (its step is the measured median)
    allocator_peak_bytes: dict[str, int] | None = None  # the CUDA allocator's peak, where the run recorded it
    device_labels: list[str] = field(default_factory=list)
    withheld: str | None = None  # why its step is no prediction (too wide an interval, a loaded calibration)
    profile: Profile | None = None  # what runs it for real (dpprof.launch); command is its shell command
    no_command: str | None = None  # why no command runs it (dpprof.advise.commands.no_command)

    @property
    def interval_ratio(self) -> float:
        """The interval's high end over its low end (inf where the low end is 0)."""
        return self.step_ms_high / self.step_ms_low if self.step_ms_low > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        out = {"scenario": self.scenario, "devices": self.devices, "batch_size": self.batch_size,
               "step_ms": round(self.step_ms, 4), "step_ms_low": round(self.step_ms_low, 4),
               "step_ms_high": round(self.step_ms_high, 4), "peak_bytes": dict(self.peak_bytes),
               "parts_ms": {k: round(v, 4) for k, v in self.parts_ms.items()}, "label": self.label,
               "changes": list(self.changes), "command": self.command, "recorded": self.recorded,
               "withheld": self.withheld}
        if self.allocator_peak_bytes is not None:
            out["allocator_peak_bytes"] = dict(self.allocator_peak_bytes)
        return out


@dataclass
class Advice:
    """Every scenario predicted from one run."""

    run_id: str
    measured: Measured
    calibration: Calibration | None
    scenarios: list[Scenario]
    max_batch_size: dict[str, int]  # per device: the largest global batch at which it still fits
    max_batch_note: str  # where the capacity came from, or why there is none
    assumptions: list[str]  # what the model assumed rather than measured, in sentences
    said_first: list[str] = field(default_factory=list)  # said before any figure: stalls, a loaded calibration
    withheld: str | None = None  # why no scenario is predicted (a run too noisy, a calibration under load)
    compute: ComputeProbe | None = None  # the run's model measured alone, where the predictions used it

    @property
    def measured_step_ms(self) -> float:
        return self.measured.step_ms

    def headline(self) -> Scenario | None:
        """The fastest predicted set-up at the recorded batch among those meaningfully faster than the recorded one
        (faster_than_recorded); the recorded one where none is; None where the predictions are withheld."""
        if self.withheld is not None:
            return None
        recorded = next((s for s in self.scenarios if s.recorded), None)
        at_batch = [s for s in self.scenarios if s.batch_size == self.measured.batch_size and s.withheld is None
                    and not s.recorded and recorded is not None and faster_than_recorded(s, recorded)]
        return min(at_batch, key=lambda s: s.step_ms, default=recorded)

    def to_json(self) -> dict[str, Any]:
        m = self.measured
        return {"run": self.run_id, "measured_step_ms": round(m.step_ms, 4), "measured_training_only": m.training_only,
                "scenarios": [s.to_json() for s in self.scenarios], "max_batch_size": dict(self.max_batch_size),
                "max_batch_note": self.max_batch_note, "batch_size": m.batch_size, "devices": list(m.devices),
                "kind": m.kind, "backend": m.backend, "recorded_parts_ms": {k: round(v, 4) for k, v in self._recorded().items()},
                "assumptions": list(self.assumptions), "said_first": list(self.said_first),
                "withheld": self.withheld, "calibration": self.calibration.to_json() if self.calibration is not None else None,
                "compute": self.compute.to_json() if self.compute is not None else None}

    def _recorded(self) -> dict[str, float]:
        return next((s.parts_ms for s in self.scenarios if s.recorded), {})


def faster_than_recorded(s: Scenario, recorded: Scenario) -> bool:
    """Whether ``s`` is meaningfully faster than the recorded set-up: its whole interval (whose width already
    allows for two runs' medians and the run-to-run spread) lies below the recorded set-up's step."""
    return s.step_ms_high < recorded.step_ms


# -- compute along the batch -------------------------------------------------------------------------------


class _Compute:
    """Each recorded device's compute per sample, by its place in the batch, and the per-chunk part."""

    sums_gradients = False  # the replicas' gradients' sums are not in the compute: _Model._grad_sum adds them

    def __init__(self, m: Measured, per_device_ms: dict[str, float], fixed_ms: float, share: float) -> None:
        self.batch = m.batch_size
        self.fixed = fixed_ms
        self.spans: list[tuple[float, float, float]] = []  # (start, end) as fractions of the batch, ms per sample
        start = 0
        for device, chunk in zip(m.devices, m.chunks):
            if chunk <= 0:
                continue
            alone = per_device_ms.get(device, 0.0) / share
            per_sample = max(0.0, alone - fixed_ms) / chunk
            self.spans.append((start / self.batch, (start + chunk) / self.batch, per_sample))
            start += chunk

    def chunk_ms(self, begin: int, end: int, batch: int, per_chunk: bool = True) -> float:
        """Compute of samples [begin, end) of a batch of ``batch``, each sample costing what the recorded device at
        the same place in the batch paid per sample, plus the per-chunk part."""
        if end <= begin:
            return 0.0
        lo, hi = begin / batch, end / batch
        ms = 0.0
        for a, b, per_sample in self.spans:
            overlap = max(0.0, min(hi, b) - max(lo, a))
            ms += overlap * batch * per_sample
        return ms + (self.fixed if per_chunk else 0.0)

    def chunks_ms(self, batch: int, devices: int, per_chunk: bool = True) -> list[float]:
        out, start = [], 0
        for size in chunk_sizes(batch, devices):
            out.append(self.chunk_ms(start, start + size, batch, per_chunk))
            start += size
        return out

    def graphs_ms(self, batch: int, devices: int) -> float:
        """What backward over the chunks' graphs is proportional to: their compute."""
        return sum(self.chunks_ms(batch, devices))


class _MeasuredCompute:
    """Each chunk's compute from the run's model measured alone (dpprof.advise.compute), one thread, at the level
    the run shows: on k >= 2 workers a chunk takes ``contention`` times its time alone (the recorded chunks' time on
    their workers over the same chunks' alone: the workers beside each other, the recording's own work), on one
    device, where the model runs on the caller with nothing beside it, its time alone (x ``level`` where the run
    itself was on one device)."""

    sums_gradients = True  # backward over k graphs, measured, holds their gradients' sums

    def __init__(self, probe: ComputeProbe, alone: dict[str, float], m: Measured) -> None:
        self.probe = probe
        recorded = probe.get(m.batch_size, m.n).forward_ms
        working = [d for d, c in zip(m.devices, m.chunks) if c > 0]
        ratios = [alone[d] / ms for d, ms in zip(working, recorded) if ms > 0 and d in alone]
        self.contention = statistics.median(ratios) if ratios else 1.0
        self.level_one = self.contention if m.n == 1 else 1.0

    def chunks_ms(self, batch: int, devices: int, per_chunk: bool = True) -> list[float]:
        times = self.probe.get(batch, devices)
        scale = self.level_one if len(times.forward_ms) == 1 else self.contention
        return [ms * scale for ms in times.forward_ms]

    def graphs_ms(self, batch: int, devices: int) -> float:
        return self.probe.get(batch, devices).backward_ms

    def rank_ms(self, chunk: int) -> tuple[float, float]:
        """A DDP rank's forward and its backward basis on its own chunk: beside the other ranks, as the workers were."""
        times = self.probe.get(chunk, 1)
        return times.forward_ms[0] * self.contention, times.backward_ms * self.contention


def _speedup(threads: int, t: int, measured: float | None) -> float:
    """How much faster a per-sample computation runs on t intra-op threads than on one: linear between 1 (one
    thread) and the calibration's speedup at the recorded count; ``threads`` (ideal) where not measured."""
    if t <= 1 or threads <= 1:
        return 1.0
    top = measured if measured is not None else float(threads)
    t = min(t, threads)
    return 1.0 + (top - 1.0) * (t - 1) / (threads - 1)


# -- the scenarios -----------------------------------------------------------------------------------------


def _present(used: int, balanced: bool) -> tuple[str, ...]:
    """The parts a step of DataParallel on ``used`` devices has."""
    if used == 1:
        return ("scatter", "apply", "loss", "backward", "rest")
    if balanced:
        return ("scatter", "replicate", "parallel_apply", "loss", "reduce", "backward", "rest")
    return ("scatter", "replicate", "parallel_apply", "gather", "loss", "backward", "rest")


class _Model:
    def __init__(self, m: Measured, cal: Calibration | None, probe: ComputeProbe | None = None) -> None:
        self.m, self.cal = m, cal
        n, T = m.n, m.threads
        # the cores this job gets: the calibration's measure of them (fewer than the host's where other jobs run)
        C = cal.effective_cores if cal is not None and cal.effective_cores else float(max(1, m.cores))
        self.n, self.T, self.C = n, T, C
        self.cpu = m.backend == "cpu"
        self._raw_skew = _max_of_draws(m.apply_ratios, n)  # see raw_skew
        self.share_n = self._share(n)
        self.over_n = self._oversubscribed(n, self.share_n)
        scale = m.step_ms / m.typical_step_ms if m.typical_step_ms > 0 else 1.0
        # the typical step's parts, scaled to add up to the median step
        self.parts = {p: v * scale for p, v in m.parts_ms.items()}
        self.apply = {d: v * scale for d, v in m.apply_ms.items()}
        self.loss_apply = {d: v * scale for d, v in m.loss_apply_ms.items()}
        self.fixed = m.fixed_apply_ms * scale
        # per-sample compute at one thread, alone on its cores
        self.speed_n = _speedup(T, self.share_n, cal.thread_speedup if cal else None)
        share = self.over_n / self.speed_n if self.cpu else 1.0
        self.forward: _Compute | _MeasuredCompute = _Compute(m, self.apply, self.fixed, share)
        if probe is not None and self.cpu:  # the model measured alone: compute per chunk and backward from that
            self.forward = _MeasuredCompute(probe, {d: v / share for d, v in self.apply.items()}, m)
        self.balanced = m.kind == "balanced"
        self.grad_mib = m.param_bytes / 2**20
        self.copy_ms_per_mib = cal.copy_ms_per_mib if cal else 0.0
        self.link_ms_per_mib, self.link_source = self._link(m)
        if not self.cpu:  # between GPUs, copies and sums of gradients cross the link
            self.copy_ms_per_mib = self.link_ms_per_mib
        # backward on the caller: each replica's graph (in proportion to its compute) plus the gradients' sum
        graphs = self.forward.chunks_ms(m.batch_size, n)
        self.reduce_n = 0.0 if self.forward.sums_gradients else self._grad_sum(n)
        # the caller's time per ms of one thread's work alone: its T threads' speed-up, the cores it gets
        self.caller_factor = (self._oversubscribed(1, T) / _speedup(T, T, cal.thread_speedup if cal else None)
                              if self.cpu else 1.0)
        denominator = self.forward.graphs_ms(m.batch_size, n) * self.caller_factor
        if not self.cpu:  # GPUs run their replicas' backward at once: the slowest device's sets the time
            denominator = max(graphs, default=0.0)
        self.backward_per_compute = max(0.0, self.parts["backward"] - self.reduce_n - self._machinery("backward", n)) / (
            denominator) if denominator > 0 else 0.0
        if self.balanced:  # the whole batch's loss, were it computed on the caller
            per_device = sum(max(0.0, v - self._machinery("criterion_apply", n)) for v in self.loss_apply.values())
            self.loss_compute = per_device * self.speed_n / self.over_n * self.caller_factor
        else:
            self.loss_compute = max(0.0, self.parts["loss"] - self._machinery("loss", n))
        # level from the run: what the recorded parts hold beyond the model's own figure for the recorded set-up
        # (DataParallel's machinery as the calibration measured it, on this run's model), added to every prediction
        raw = self._raw(n, m.batch_size, self.balanced)
        self.offsets = {p: self.parts.get(p, 0.0) - v for p, v in raw.items()}

    # threads and cores
    def _share(self, k: int) -> int:
        """Intra-op threads each of k workers runs with (the caller's count split among them, at least one); the
        caller's own count at k = 1, where the apply runs on the caller."""
        return self.T if k <= 1 else max(1, self.T // k)

    def _oversubscribed(self, k: int, share: int) -> float:
        return max(1.0, k * share / self.C) if self.cpu else 1.0

    def _machinery(self, phase: str, k: int, balanced: bool | None = None) -> float:
        if self.cal is None:
            return 0.0
        return self.cal.machinery(self.balanced if balanced is None else balanced, k, phase)

    def _link(self, m: Measured) -> tuple[float, str]:
        """ms per MiB between devices: on GPUs from the run's own transfers (gathered outputs, else the scattered
        inputs), else assumed; unused on CPU workers."""
        if self.cpu:
            return 0.0, ""
        for part, per_sample in (("gather", m.output_bytes_per_sample), ("scatter", m.input_bytes_per_sample)):
            mib = per_sample * m.batch_size / 2**20
            if m.parts_ms.get(part, 0.0) > 0 and mib >= 1:
                return m.parts_ms[part] / mib, f"measured from the run's {part} ({mib:.1f} MiB a step)"
        return ASSUMED_LINK_MS_PER_MIB, "assumed at 12 GB/s (PCIe 3.0 x16): the run moved too little to measure it"

    def _grad_sum(self, k: int) -> float:
        """Summing k replicas' gradients onto device_ids[0] in backward: k - 1 additions of the weights' size."""
        return max(0, k - 1) * self.grad_mib * self.copy_ms_per_mib

    # DataParallel and balanced on k devices, batch B
    def _raw(self, k: int, batch: int, balanced: bool) -> dict[str, float]:
        """The parts from the model's rates alone: compute from the run's per-sample figures, DataParallel's own
        machinery from the calibration, replicate in proportion to its recorded copies."""
        m = self.m
        used = len(chunk_sizes(batch, k))
        share = self._share(used)
        over = self._oversubscribed(used, share)
        speed = _speedup(self.T, share, self.cal.thread_speedup if self.cal else None) if self.cpu else 1.0
        compute = self.forward.chunks_ms(batch, k)
        apply = [c / speed * over for c in compute]
        parts: dict[str, float] = {"scatter": self._machinery("scatter", used, balanced)}
        if used == 1:  # the module runs on the caller: no replicate, no workers, nothing to gather
            parts.update(replicate=0.0, apply=apply[0], parallel_apply=0.0, gather=0.0)
        else:
            # the call's own cost and the per-replica machinery (the calibration's), and a copy of the weights for
            # each replica but the first
            parts["replicate"] = (self._machinery("replicate", used, balanced)
                                  + (used - 1) * self.grad_mib * self.copy_ms_per_mib)
            parts["apply"] = 0.0
            parts["parallel_apply"] = max(apply) + self._machinery("dispatch", used, balanced)
            parts["gather"] = 0.0 if balanced else (m.output_bytes_per_sample * batch / 2**20 * self.copy_ms_per_mib
                                                    + self._machinery("gather", used, False))
        if balanced and used > 1:  # each device's share of the loss, on its worker
            losses = [self.loss_compute / self.caller_factor * (c / batch) / speed * over for c in chunk_sizes(batch, k)]
            parts["loss"] = max(losses) + sum(self._machinery(p, used, True) for p in (
                "criterion_scatter", "criterion_replicate", "criterion_dispatch", "criterion_apply"))
            parts["reduce"] = self._machinery("reduce", used, True)
        else:  # the whole batch's loss on the caller
            parts["loss"] = self.loss_compute * batch / m.batch_size + self._machinery(
                "criterion_apply" if balanced else "loss", used, balanced)
            parts["reduce"] = 0.0
        graphs = self.forward.graphs_ms(batch, k) * self.caller_factor if self.cpu else max(compute)
        parts["backward"] = (self.backward_per_compute * graphs
                             + (0.0 if self.forward.sums_gradients else self._grad_sum(used))
                             + self._machinery("backward", used, balanced))
        parts["rest"] = self.parts["rest"] - self._machinery("rest", self.n) + self._machinery("rest", used, balanced)
        return parts

    def dataparallel(self, k: int, batch: int, balanced: bool) -> dict[str, float]:
        """The model's parts plus the run's level (``offsets``): at the recorded set-up, exactly the recorded
        parts. The loss's and the gather's levels carry only to the same kind (plain or balanced); at one device
        the dispatch's level goes with the workers."""
        parts = self._raw(k, batch, balanced)
        same_kind = balanced == self.balanced
        present = set(_present(len(chunk_sizes(batch, k)), balanced))
        for part, offset in self.offsets.items():
            if part in present and (same_kind or part not in ("loss", "reduce", "gather")):
                parts[part] = max(0.0, parts[part] + offset)
        return parts

    # DDP on the recorded devices, the same global batch
    def ddp(self) -> tuple[dict[str, float], list[dict[str, float]]]:
        m = self.m
        n = self.n
        over = self._oversubscribed(n, 1)  # each rank one intra-op thread, all at once on the cores this job gets
        ranks = []
        forwards = self.forward.chunks_ms(m.batch_size, n)
        for c, fwd in zip(chunk_sizes(m.batch_size, n), forwards):
            basis = fwd  # the caller's backward per compute, on one thread
            if isinstance(self.forward, _MeasuredCompute):  # a rank's own chunk, measured alone
                fwd, basis = self.forward.rank_ms(c)
            backward = self.backward_per_compute * basis
            rank = {"forward": fwd * over,
                    "loss": self.loss_compute / self.caller_factor * c / m.batch_size * over,
                    "backward_compute": backward * over}
            ranks.append(rank)
        slowest = max(ranks, key=lambda r: sum(r.values()))
        wait = self._allreduce_wait(slowest["backward_compute"]) + self.rank_skew_ms(slowest)
        parts = {**slowest, "comm_wait": wait,
                 # the step's own work (optimizer, Python) without DataParallel's bookkeeping, with DDP's, and while
                 # the ranks share cores, the other ranks' loading of their next batch (between their steps, on the
                 # cores this rank's step needs)
                 "rest": max(0.0, self.parts["rest"] - self._machinery("rest", n))
                 + (self.cal.ddp_overhead_ms if self.cal else 0.0) + self.ddp_data_ms()}
        return parts, ranks

    def raw_skew(self) -> float:
        """How much longer the slowest of n ranks' compute is in a step than one rank's on average, as a share:
        each rank's step moves as the recorded applies did (apply_ratios), independently of the others' (each rank
        has its own batch), and every step waits for the slowest at the all-reduce (_max_of_draws, worked out once
        per model)."""
        return self._raw_skew

    def skew_weight(self) -> float:
        """How much of the skew a DDP step pays: all of it where each rank has a core (or a GPU) of its own, none
        where the ranks time-share cores (each step then takes every rank's work on the shared cores, over(n),
        however it falls; and the recorded applies' spread is mostly the scheduler's order within the step),
        linear between: 2 - over(n), within 0 and 1."""
        return min(1.0, max(0.0, 2.0 - self._oversubscribed(self.n, 1)))

    def rank_skew(self) -> float:
        """The share of a rank's compute a DDP step waits for the slowest rank: raw_skew x skew_weight."""
        return self.raw_skew() * self.skew_weight()

    def rank_skew_ms(self, rank: dict[str, float]) -> float:
        """The wait the ranks' step-to-step spread adds: rank_skew of the slowest rank's forward, loss and backward."""
        return self.rank_skew() * sum(rank.values())

    def ddp_data_ms(self) -> float:
        """What a DDP step waits out of the other ranks' batch loading while they share the cores: each rank loads
        its share of the recorded gap between steps; k ranks on C cores overlap (k / C - 1) of it with a step."""
        if not self.cpu:
            return 0.0
        over = self._oversubscribed(self.n, 1)
        return (over - 1.0) * self.m.gap_ms * max(chunk_sizes(self.m.batch_size, self.n)) / self.m.batch_size

    def buckets(self) -> list[int]:
        """DDP's gradient buckets in the order backward fills them (bytes): 1 MiB first, then up to 25 MiB."""
        left, out = self.m.param_bytes, []
        cap = DDP_FIRST_BUCKET_BYTES
        while left > 0:
            out.append(min(left, cap))
            left -= out[-1]
            cap = DDP_BUCKET_BYTES
        return out

    def _allreduce_wait(self, backward_ms: float) -> float:
        """How long backward's end waits for the last bucket's all-reduce: each bucket is launched when backward
        has computed its share of the gradients (taken as even over backward), all-reduces run one at a time."""
        if not self.m.param_bytes or (self.cpu and self.cal is None):
            return 0.0
        total = self.m.param_bytes
        done_ms, filled = 0.0, 0
        for size in self.buckets():
            filled += size
            launch = backward_ms * filled / total
            done_ms = max(done_ms, launch) + self.allreduce_ms(size)
        return max(0.0, done_ms - backward_ms)

    def allreduce_ms(self, nbytes: int) -> float:
        """One bucket's all-reduce: gloo at the calibrated cost on CPU workers; on GPUs NCCL's ring, each rank
        sending and receiving 2 (n - 1) / n of the bucket over the link, plus NCCL_LATENCY_MS."""
        if self.cpu:  # the ranks' meeting, as a real DDP run waits for it, and the bytes at the burst's rate
            return self.cal.ddp_sync_ms + self.cal.allreduce_ms_per_mib * nbytes / 2**20 if self.cal is not None else 0.0
        return NCCL_LATENCY_MS + 2 * (self.n - 1) / self.n * nbytes / 2**20 * self.link_ms_per_mib

    # memory
    def memory(self, k: int, batch: int, balanced: bool) -> dict[str, int]:
        m = self.m
        devices = _labels(m, k)
        sizes = chunk_sizes(batch, k)
        per_sample = _Density(m, "model_bytes")
        fixed = m.memory[m.devices[0]].fixed_bytes
        out: dict[str, int] = {}
        start = 0
        first = m.memory[m.devices[0]]
        peak_batch = first_batch(m)
        loss_per_sample = sum(d.loss_bytes for d in m.memory.values()) / peak_batch
        gathered_per_sample = (first.gathered_bytes / peak_batch if m.kind != "balanced"
                               else m.output_bytes_per_sample)
        for i, device in enumerate(devices):
            size = sizes[i] if i < len(sizes) else 0
            if not size:
                out[device] = 0
                continue
            held = fixed + per_sample.bytes(start, start + size, batch)
            if balanced and len(sizes) > 1:
                held += loss_per_sample * size
            elif i == 0:
                held += loss_per_sample * batch
                if len(sizes) > 1:
                    held += gathered_per_sample * batch
            out[device] = int(round(held))
            start += size
        return out

    def ddp_memory(self) -> dict[str, int]:
        m = self.m
        per_sample = _Density(m, "model_bytes")
        fixed = m.memory[m.devices[0]].fixed_bytes
        out, start = {}, 0
        for i, size in enumerate(chunk_sizes(m.batch_size, m.n)):
            out[f"rank:{i}"] = int(round(fixed + per_sample.bytes(start, start + size, m.batch_size)))
            start += size
        return out


def _max_of_draws(ratios: tuple[float, ...], n: int) -> float:
    """E[max of n independent draws] of ``ratios`` over their mean, less 1, exactly: the i-th smallest of m is the
    largest of n draws with probability (i/m)^n - ((i-1)/m)^n. 0 for fewer than 2 ratios or draws."""
    ordered = sorted(ratios)
    m = len(ordered)
    if m < 2 or n < 2:
        return 0.0
    mean = sum(ordered) / m
    top = sum(r * ((i / m) ** n - ((i - 1) / m) ** n) for i, r in enumerate(ordered, 1))
    return max(0.0, top / mean - 1.0) if mean > 0 else 0.0


def _labels(m: Measured, k: int) -> list[str]:
    """k devices' labels: the recorded ones first, then the next indices of the same kind."""
    prefix = m.devices[0].split(":")[0]
    top = max(int(d.split(":")[1]) for d in m.devices)
    extra = [f"{prefix}:{top + 1 + i}" for i in range(max(0, k - m.n))]
    return (list(m.devices) + extra)[:k]


def first_batch(m: Measured) -> int:
    """The global batch of the output device's peak step (its gathered outputs are that batch's)."""
    return sum(d.chunk for d in m.memory.values()) or m.batch_size


class _Density:
    """Bytes per sample of each recorded device at its place in the batch (its peak step's chunk)."""

    def __init__(self, m: Measured, what: str) -> None:
        total = sum(d.chunk for d in m.memory.values())
        self.spans, start = [], 0
        for device in m.devices:
            d = m.memory[device]
            if d.chunk > 0 and total:
                self.spans.append((start / total, (start + d.chunk) / total, getattr(d, what) / d.chunk))
                start += d.chunk

    def bytes(self, begin: int, end: int, batch: int) -> float:
        lo, hi = begin / batch, end / batch
        return sum(max(0.0, min(hi, b) - max(lo, a)) * batch * per for a, b, per in self.spans)


# -- putting it together -----------------------------------------------------------------------------------


def _interval(m: Measured, step: float, recorded: float) -> tuple[float, float]:
    """The widest of: the middle half of the recorded steps, the 90% interval of their median (x sqrt 2, for two
    runs' medians), RUN_TO_RUN_SHARE either side; scaled to the prediction, widened by EXTRAPOLATION_SHARE of its
    change from the recorded median."""
    lo, hi = m.median_interval
    lo, hi = 1 - math.sqrt(2) * (1 - lo), 1 + math.sqrt(2) * (hi - 1)
    lo = min(lo, m.step_quartiles[0], 1 - RUN_TO_RUN_SHARE)
    hi = max(hi, m.step_quartiles[1], 1 + RUN_TO_RUN_SHARE)
    extra = EXTRAPOLATION_SHARE * abs(step - recorded)
    return max(0.0, step * lo - extra), step * hi + extra


# Parts that move rather than vanish: (from, to, where to) -> said as one move
MOVES = (("parallel_apply", "forward", "into each rank's forward, on its own chunk"),
         ("apply", "forward", "into each rank's forward, on its own chunk"),
         ("parallel_apply", "apply", "onto the caller, the whole batch in one call"),
         ("backward", "backward_compute", "onto each rank, for its own chunk (no replicas' gradients to sum)"))


def _changes(parts: dict[str, float], base: dict[str, float], balanced_from_plain: bool = False) -> list[str]:
    """What changes against the recorded step, part by part, in sentences with the predicted ms: parts that
    move (DataParallel's apply and backward into DDP's ranks, the loss onto every device), vanish, appear, shrink
    or grow."""
    out, said = [], set()
    for src, dst, where in MOVES:
        new, old = parts.get(dst, 0.0), base.get(src, 0.0)
        if old > 0.0005 and new > 0.0005 and parts.get(src, 0.0) <= 0.0005 and base.get(dst, 0.0) <= 0.0005:
            out.append(f"{PART_WORDS[src]} moves {where}: {old:.2f} -> {new:.2f} ms")
            said |= {src, dst}
    if balanced_from_plain and base.get("loss", 0.0) > 0:
        out.append(f"the loss moves from the output device onto every device, each its share with the criterion's "
                   f"scatter, replicate and dispatch: {base['loss']:.2f} -> {parts.get('loss', 0.0):.2f} ms")
        said.add("loss")
    for part in PART_ORDER:
        if part in said:
            continue
        new, old = parts.get(part, 0.0), base.get(part, 0.0)
        words = PART_WORDS[part]
        if new <= 0 and old <= 0:
            continue
        if new <= 0.0005 and old > 0:
            out.append(f"{words} vanishes ({old:.2f} ms -> 0)")
        elif old <= 0.0005:
            out.append(f"{words} appears: {new:.2f} ms")
        elif abs(new - old) >= max(0.01, 0.02 * old):
            verb = "shrinks" if new < old else "grows"
            out.append(f"{words} {verb}: {old:.2f} -> {new:.2f} ms")
    return out


def other_batches(m: Measured, batch_sizes: list[int] | None = None) -> list[int]:
    """The global batch sizes weighed at the recorded device count besides the recorded one (default: half and
    twice it), each once, in the order given."""
    asked = batch_sizes or sorted({max(1, m.batch_size // 2), m.batch_size * 2})
    return [b for b in dict.fromkeys(asked) if b != m.batch_size]


def compute_layouts(m: Measured, batch_sizes: list[int] | None = None) -> list[tuple[int, int]]:
    """Every (batch, devices) split the scenarios run the model on (dpprof.advise.compute measures each): the
    recorded batch on 1 to 2n devices, each DDP rank's chunk on its own, the other batches on n."""
    B, n = m.batch_size, m.n
    # one layout per split: batch 6 on 4 devices is the 6 on 3 of [2, 2, 2] (layout_key), measured once
    return list(dict.fromkeys([layout_key(B, k) for k in range(1, 2 * n + 1)]
                              + [(c, 1) for c in sorted(set(chunk_sizes(B, n)))]
                              + [layout_key(b, n) for b in other_batches(m, batch_sizes)]))


def advise(m: Measured, cal: Calibration | None, batch_sizes: list[int] | None = None,
           memory_bytes: int | None = None, steps: int | None = None, compute: ComputeProbe | None = None) -> Advice:
    """Every scenario of one run: DDP on its devices, DataParallel on 1 .. 2n devices, balanced, other batch sizes.

    Args:
        m: the run's figures (dpprof.advise.measured.measure).
        cal: this machine's calibration for the run's device set (None: DataParallel's machinery, the hand-off and
            the all-reduce count as nothing, said in the assumptions).
        batch_sizes: other global batch sizes (default: half and twice the recorded one).
        memory_bytes: each device's capacity for the largest batch that fits (CPU workers; a GPU's is its own).
        steps: steps for each scenario's command (default: the run's own).
        compute: the run's model measured alone (dpprof.advise.compute); used where it holds every split the
            scenarios need (compute_layouts), else each chunk's compute is the recorded per sample.
    """
    if m.batch_size < 1:
        raise NotAdvisable(f"run {m.run_id} has no batch size in its steps: nothing to split over devices")
    if compute is not None and not (m.backend == "cpu" and compute.covers(compute_layouts(m, batch_sizes))):
        compute = None
    model = _Model(m, cal, compute)
    n, B = m.n, m.batch_size
    device = "CPU worker" if m.backend == "cpu" else "GPU"
    recorded_kind_balanced = m.kind == "balanced"
    base_parts = model.dataparallel(n, B, recorded_kind_balanced)
    recorded_step = sum(base_parts.values())
    scenarios: list[Scenario] = []

    def add(scenario: str, k: int, batch: int, parts: dict[str, float], memory: dict[str, int], label: str,
            extra: list[str] | None = None, recorded: bool = False) -> None:
        step = sum(parts.values())
        profile = profile_for(m, scenario, k, batch, steps)
        lo, hi = _interval(m, step, recorded_step)
        changes = (extra or []) + _changes(parts, base_parts, scenario == "balanced" and not recorded_kind_balanced)
        alloc = None
        if any(d.allocator_peak_bytes is not None for d in m.memory.values()) and scenario != "ddp":
            base_memory = model.memory(n, B, recorded_kind_balanced)
            alloc = {}
            for device, held in memory.items():
                recorded_dev = m.memory.get(device)
                if recorded_dev is not None and recorded_dev.allocator_peak_bytes is not None and held:
                    alloc[device] = int(recorded_dev.allocator_peak_bytes + held - base_memory.get(device, 0))
        scenarios.append(Scenario(
            scenario=scenario, devices=k, batch_size=batch, step_ms=step, step_ms_low=lo, step_ms_high=hi,
            peak_bytes=memory, parts_ms={p: parts[p] for p in PART_ORDER if p in parts}, label=label,
            changes=changes, command=None if profile is None else profile.command(), recorded=recorded,
            allocator_peak_bytes=alloc, profile=profile, no_command=no_command(m, scenario, k, batch)))
        if not recorded and scenarios[-1].interval_ratio > MAX_INTERVAL_RATIO:
            ratio = scenarios[-1].interval_ratio
            scenarios[-1].withheld = (f"its interval, {lo:,.2f}-{hi:,.2f} ms, spans "
                                      + (f"{ratio:,.0f}x" if math.isfinite(ratio) else "down to 0")
                                      + f" (over {MAX_INTERVAL_RATIO:g}x): too wide to tell it from the other set-ups")

    # DDP on the same devices, the same global batch
    ddp_parts, ranks = model.ddp()
    skew_ms = model.rank_skew_ms({p: ddp_parts[p] for p in ("forward", "loss", "backward_compute")})
    per_rank = chunk_sizes(B, n)
    ddp_label = f"DDP on {plural(n, 'rank')} ({'gloo' if m.backend == 'cpu' else 'NCCL'}), {per_rank[0]} samples each"
    buckets = model.buckets()
    ddp_notes = [f"no scatter, replicate or gather: each rank keeps its model and its own {per_rank[0]} samples; "
                 + ("one intra-op thread a rank; " if m.backend == "cpu" else "")
                 + "the step waits for the slowest rank, whose parts these are",
                 f"{plural(len(buckets), 'gradient bucket')} of {', '.join(mib(b) for b in buckets)} all-reduced "
                 f"({model.allreduce_ms(buckets[0]) if buckets else 0:.2f} ms for the first); what backward does not "
                 f"hide is the wait, {ddp_parts['comm_wait'] - skew_ms:.2f} ms"]
    if model.raw_skew() > 0.0005:
        weight = model.skew_weight()
        shared = (f"; the ranks share the {model.C:.2f} cores this job gets, which take every rank's work whatever "
                  f"its order, so {weight:.0%} of it counts" if weight < 0.95 else "")
        ddp_notes.append(f"each rank's step moves as the recorded applies did (their 5th-95th percentiles "
                         f"{min(m.apply_ratios):.2f}-{max(m.apply_ratios):.2f}x their mean), each rank with its own "
                         f"batch: at the all-reduce each step waits for the slowest of {n}, on average "
                         f"{model.raw_skew():.1%} over one rank's compute{shared}: {skew_ms:.2f} ms (in the all-reduce "
                         "wait)")
    if model.ddp_data_ms() >= 0.005:  # said where it shows in two decimals
        # a run recorded with the DataLoader watch on that iterated none loaded no batch there (dpprof.loaders)
        between = ("work between their steps (no DataLoader ran: the script's own, building the next batch, logging)"
                   if said_in(m.workload_args) == [] else "loading of their next batch")
        ddp_notes.append(f"the ranks share the {model.C:.2f} cores this job gets: each step also waits out the other "
                         f"ranks' {between}, {model.ddp_data_ms():.2f} ms (in the rest)")
    if B % n:
        ddp_notes.append(f"{B} does not split evenly over {plural(n, 'rank')}: the prediction gives them torch.chunk's "
                         f"{per_rank}, the command each rank {plural(per_rank[0], 'sample')} ({per_rank[0] * n} a "
                         "step), the biggest chunk, which the step waits for")
    add("ddp", n, B, ddp_parts, model.ddp_memory(), ddp_label, ddp_notes)

    # DataParallel on 1 .. 2n devices (the recorded kind for a balanced run is balanced: plain here)
    for k in range(1, 2 * n + 1):
        parts = model.dataparallel(k, B, False)
        same = k == n and not recorded_kind_balanced
        notes = _split_notes(m, model, k, B, device)
        if k == 1:
            notes.append("one device: no replicate, no parallel apply, no gather; the model runs on the caller")
        add("dataparallel", k, B, parts, model.memory(k, B, False),
            f"DataParallel on {plural(k, device)}" + (" (recorded)" if same else ""), notes,
            recorded=same)

    # balanced on the recorded devices (not on one: it has no outputs to leave ungathered, nothing to balance)
    if n > 1 or recorded_kind_balanced:
        parts = model.dataparallel(n, B, True)
        notes = ([] if recorded_kind_balanced else
                 ["nothing is gathered: each device keeps its outputs and computes its share of the loss"])
        add("balanced", n, B, parts, model.memory(n, B, True),
            f"DataParallelModel + DataParallelCriterion on {plural(n, device)}" + (" (recorded)" if recorded_kind_balanced else ""),
            notes, recorded=recorded_kind_balanced)

    # other batch sizes, at the recorded device count and kind (DataParallel entries with their batch size)
    for batch in other_batches(m, batch_sizes):
        parts = model.dataparallel(n, batch, recorded_kind_balanced)
        add("balanced" if recorded_kind_balanced else "dataparallel", n, batch, parts,
            model.memory(n, batch, recorded_kind_balanced), f"batch {batch} on {plural(n, device)}",
            _split_notes(m, model, n, batch, device))

    fits, note = _max_batch(m, model, memory_bytes)
    said_first, withheld = _withheld(m, cal, scenarios)
    return Advice(run_id=m.run_id, measured=m, calibration=cal, scenarios=scenarios, max_batch_size=fits,
                  max_batch_note=note, assumptions=_assumptions(m, cal, model), said_first=said_first, withheld=withheld,
                  compute=compute)


def _split_notes(m: Measured, model: _Model, k: int, batch: int, device: str) -> list[str]:
    """What DataParallel on k devices does with ``batch`` that the parts do not say: the devices torch.chunk gives
    no chunk (they run nothing: DataParallel replicates onto and applies on the devices given one), and on CPU
    workers, the cores the working ones share, as _Model._raw weighs them."""
    chunks = chunk_sizes(batch, k)
    used = len(chunks)
    notes = []
    if used < k:
        notes.append(f"torch.chunk splits batch {batch} into {chunks}: {plural(k - used, device)} of {k} "
                     f"{'gets' if k - used == 1 else 'get'} no chunk and {'runs' if k - used == 1 else 'run'} nothing")
    if m.backend == "cpu" and used * model._share(used) > model.C:
        notes.append(f"{used} worker{'s share' if used != 1 else ' shares'} the {model.C:.2f} cores this job gets: "
                     f"each apply runs {model._oversubscribed(used, model._share(used)):.1f}x its time alone")
    return notes


def _withheld(m: Measured, cal: Calibration | None, scenarios: list[Scenario]) -> tuple[list[str], str | None]:
    """What is said before any figure (why no scenario is predicted, first; the run's stalls) and why no scenario is
    predicted, where none is: a calibration whose own figures say the machine was loaded
    (Calibration.loaded_reason), or a run whose own spread makes even the recorded set-up's interval span over
    MAX_INTERVAL_RATIO. Marks every scenario but the recorded one withheld then."""
    said = [note for note in (m.incomplete_note, m.stall_note) if note]
    withheld = None
    loaded = cal.loaded_reason() if cal is not None else None
    recorded = next((s for s in scenarios if s.recorded), None)
    if loaded is not None:
        withheld = (f"No predictions: {loaded}. `dpprof advise {m.run_id} --calibrate` measures it again (once the "
                    "machine is quieter).")
    elif recorded is not None and recorded.interval_ratio > MAX_INTERVAL_RATIO:
        lo, q25, q75, hi = m.step_spread_ms
        ratio = recorded.interval_ratio
        withheld = (f"No predictions: run {m.run_id} is too noisy to predict from. Its steps past the first took "
                    f"{lo:,.2f} to {hi:,.2f} ms, the middle half {q25:,.2f} to {q75:,.2f} ms, so even the recorded "
                    "set-up's interval spans "
                    + (f"{ratio:,.0f}x" if math.isfinite(ratio) else "down to 0")
                    + f" (over {MAX_INTERVAL_RATIO:g}x, where no two set-ups can be told apart). Record it again "
                    "while nothing else runs on this machine.")
    if withheld is not None:  # why nothing is predicted comes first: it decides every figure below it
        said.insert(0, withheld)
        for s in scenarios:
            if not s.recorded:
                s.withheld = s.withheld or withheld.removeprefix("No predictions: ")
    return said, withheld


def _max_batch(m: Measured, model: _Model, memory_bytes: int | None) -> tuple[dict[str, int], str]:
    """Per device, the largest global batch (at the recorded device count and kind) whose predicted peak fits."""
    balanced = m.kind == "balanced"
    if m.backend == "cuda" and m.total_memory_bytes:
        caps = {d: m.total_memory_bytes.get(d) for d in m.devices}
        source = "each GPU's total memory"
    elif memory_bytes:
        caps = dict.fromkeys(m.devices, memory_bytes)
        source = f"{memory_bytes / 2**30:g} GiB per device (--memory-gib)"
    else:
        return {}, ("CPU workers share the host's memory: give --memory-gib for each worker's share to get the "
                    "largest batch that fits")
    base = model.memory(m.n, m.batch_size, balanced)
    alloc_extra = {d: (peak - base[d]) if (peak := m.memory[d].allocator_peak_bytes) else 0
                   for d in m.devices if d in m.memory}
    out = {}
    for device in m.devices:
        cap = caps.get(device)
        if not cap:
            continue

        def held(batch: int) -> int:
            return model.memory(m.n, batch, balanced).get(device, 0) + alloc_extra.get(device, 0)

        if held(1) > cap:
            out[device] = 0
            continue
        lo, hi = 1, 2
        while held(hi) <= cap and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if held(mid) <= cap else (lo, mid)
        out[device] = lo
    what = "the allocator's peak" if any(alloc_extra.values()) else "dpprof's accounting of what each device holds"
    return out, f"from {what} against {source}"


def _assumptions(m: Measured, cal: Calibration | None, model: _Model) -> list[str]:
    measured = model.forward
    if isinstance(measured, _MeasuredCompute):
        probe = measured.probe
        passes = sorted(t.passes for t in probe.layouts.values())
        out = [f"Compute per chunk from the model itself, measured alone on this host ({probe.measured_at}; one "
               f"intra-op thread, each split of the batch {passes[0]}-{passes[-1]} times, the medians): on 2 or more "
               f"workers a chunk takes {measured.contention:.2f}x its time alone, as the recorded chunks did beside "
               "each other; on one device, its time alone"
               + (" at the run's level" if m.n == 1 else "") + ".",
               "Backward is the chunks' graphs measured together (the sums of their gradients included) at the run's "
               f"level ({model.backward_per_compute:.2f}x the measure); the loss scales with the samples it sees."]
    else:
        out = [f"Compute per sample from each device's apply in the typical step ({m.typical_steps} steps past the "
               f"first, the middle half by time); per chunk: {m.fixed_apply_source}.",
               "Backward is each replica's graph in proportion to its forward compute, plus the sum of the replicas' "
               "gradients on the first device; the loss scales with the samples it sees."]
        if m.backend == "cpu" and m.source != "script":
            out.append(f"The model was not measured alone on this host (`dpprof advise {m.run_id}` measures it once, "
                       + ("run where its model imports from, as dpprof profile --model was): " if m.source == "model"
                          else "in seconds): ")
                       + "smaller chunks run less efficiently than the recorded ones, and one device's "
                       "backward sums no replicas' gradients, which the recorded figures alone cannot show.")
    if m.backend == "cpu":
        cores = (f"{cal.effective_cores:.2f} of the host's {m.cores} cores (the calibration's measure of what this "
                 f"job gets, {cal.cores_measured_at}: other jobs hold the rest)" if cal is not None and
                 cal.effective_cores else f"the host's {m.cores} cores")
        out.append(f"CPU workers share {cores}: k threads at once each run at most cores/k of a core, and the recorded "
                   f"times are taken at that speed too (the recording ran {m.threads} intra-op thread(s), "
                   f"{m.threads_source}); DDP ranks run one intra-op thread each, as dpprof profile --ddp starts them.")
    if m.backend == "cuda":
        out.append("GPUs: this model has not been checked against GPU runs (it was built where there is none). Times "
                   "are the recorded host times; each GPU runs its replica's backward at once with the others; the "
                   f"link between GPUs is {_Model(m, None).link_source}; DDP's all-reduce is NCCL's ring over it plus "
                   f"{NCCL_LATENCY_MS} ms (assumed).")
    elif cal is None:
        out.append("No calibration of this machine: DataParallel's machinery, the hand-off and the all-reduce are "
                   f"taken as free (dpprof advise {m.run_id} calibrates this machine first).")
    if m.source == "script":
        out.append("The run was recorded from a script: the commands that run each scenario for real cannot be "
                   "built from it.")
    return out
