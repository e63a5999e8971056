"""What every rule takes (a run's tables and its model) and gives (finding rows)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import pandas as pd

from dpprof.records import SCRIPT_BUCKET, FindingRecord, finding_unit_error
from dpprof.stepmodel import partition, parts_for
from dpprof.store.model import RunModel

__all__ = ["FINDING_COLUMNS", "MEDIAN_STEP", "OperatorData", "Tables", "finding", "per_step", "split_script_comms"]

FINDING_COLUMNS = [f.name for f in fields(FindingRecord)]
# What a finding weighs a cost against, in its words: the median of the steps past the first (which carries one-time
# costs: Tables.median_step_ms), not the header's median of every step
MEDIAN_STEP = "median step past the first"


@dataclass
class OperatorData:
    """A run's operator-level tables (dpprof.store.detail_rows), for the rules of dpprof.findings.detail; every
    frame has ``rank`` and ``device`` columns."""

    operators: pd.DataFrame  # detail_rows.operators
    operator_steps: int  # how many steps the operator tables span (detail_rows.detail_step_count: a capture's)
    kernel_ops: pd.DataFrame  # detail_rows.kernels(by="operator")
    gpu: pd.DataFrame  # detail_rows.gpu_summary: each GPU over all steps
    gpu_steps: int  # how many steps the GPU figures span
    gpu_steps_of: dict[tuple[Any, str], int]  # (rank, device) -> the steps its GPU figures span (ranks may differ)
    peaks: pd.DataFrame  # detail_rows.memory_peaks
    operator_memory: pd.DataFrame  # detail_rows.operator_memory
    devices: pd.DataFrame  # the run's device inventory (total_memory_bytes: deviceProperties' totalGlobalMem)
    # rank -> the steps its operator tables span, where ranks differ (an imported job whose ranks' profilers held
    # different step counts); empty where every rank's span the same steps (a deep capture: operator_steps)
    operator_steps_of: dict[int, int] = field(default_factory=dict)


@dataclass
class Tables:
    """The tables the rules read (every step's, or the last steps' of a long running run) and the run's model.

    Every table has a ``rank`` column (0 for a one-file run), as dpprof.store.reader reads them.
    """

    model: RunModel
    steps: pd.DataFrame
    phases: pd.DataFrame
    memory: pd.DataFrame
    allocator: pd.DataFrame
    gpu_samples: pd.DataFrame
    comms: pd.DataFrame
    gpu_time: pd.DataFrame
    traced_dataparallel: str | None = None  # an imported trace's DataParallel: "torch" or "exact" (dpprof ranges)
    # a thinned run (dpprof.store.retention): ``steps`` are those whose detail stands for the run, like its phases;
    # every step's time is here, for the rules over step times alone (outliers) and for costs over the whole run
    all_steps: pd.DataFrame | None = None
    step_count: int | None = None  # how many steps the run has, where every step's time was not read (all_steps None)
    detail: OperatorData | None = None  # operators, kernels, GPU figures and memory peaks, where the run has them
    # rank -> its DataLoaders' settings (StoredRun.data_loaders, dpprof.loaders): [] for a rank recorded with the
    # watch on that iterated none; a rank whose file does not say (written before, a trace without them) is left out
    data_loaders: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # the collectives a recorded DDP or FSDP script called itself (records.SCRIPT_BUCKET), out of ``comms``: DDP's
    # buckets' and FSDP's figures read ``comms``; the straggler verdict reads both (``collectives``)
    script_comms: pd.DataFrame = field(default_factory=pd.DataFrame)
    # a thinned run that mixes training and evaluation steps: each kind's median over every step (the writer's
    # sketches, queries.kind_medians), and whether a backward ran in each step whose detail was kept (step -> bool)
    kind_medians: dict[str, float] | None = None
    kept_trained: pd.Series | None = None

    def __post_init__(self) -> None:
        self.comms, script = split_script_comms(self.comms)
        if len(script):
            self.script_comms = script

    @property
    def collectives(self) -> pd.DataFrame:
        """Every collective of the run, DDP's or FSDP's and the script's own: what ranks wait for each other in."""
        if self.script_comms.empty:
            return self.comms
        return pd.concat([self.comms, self.script_comms]).sort_index(kind="stable")

    @property
    def on_gpus(self) -> bool:
        """Whether the run's devices are GPUs: a DataParallel on CUDA, NCCL ranks, or ranks and traces with GPU
        records (the CUDA allocator's counters, GPU samples, kernel time); False where they share the host's cores
        (CPU workers, gloo ranks on CPUs, a trace of the CPU alone)."""
        return (self.model.backend == "cuda" or self.model.dist_backend == "nccl"
                or bool({"allocator", "gpu_samples", "gpu_time"} & self.model.has))

    @property
    def every_step(self) -> pd.DataFrame:
        """Every step of the run (``steps`` unless the run was thinned)."""
        return self.steps if self.all_steps is None else self.all_steps

    @property
    def backward_steps(self) -> pd.Series | None:
        """The steps a backward ran in (a step row per phase row: not unique), where the phases cover every step; None
        for a thinned run or one without phases, whose steps' kinds the phases cannot tell."""
        if self.all_steps is not None or "phase" not in self.phases:
            return None
        return self.phases.loc[self.phases["phase"] == "backward", "step"]

    @property
    def later_step_count(self) -> int:
        """How many steps the run has past its first: what a per-step cost is paid over."""
        if self.step_count is not None:
            return max(0, self.step_count - 1)
        return max(0, int(self.every_step["step"].nunique()) - 1)

    @property
    def step_durations_ms(self) -> pd.Series:
        """Milliseconds per step, in step order (a distributed run's ranks step together: the slowest rank's)."""
        return self.steps.groupby("step")["duration_ms"].max().sort_index()

    @property
    def later_steps(self) -> pd.Series:
        """step_durations_ms without the first step, whose one-time costs no rule counts."""
        return self.step_durations_ms.iloc[1:]

    @property
    def median_step_ms(self) -> float:
        later = self.later_steps
        return float(later.median()) if len(later) else float("nan")

    @property
    def first_step(self) -> int | None:
        return int(self.steps["step"].min()) if len(self.steps) else None

    @cached_property
    def later_step_parts(self) -> pd.DataFrame:
        """Each step past the first of each rank whose rows the run holds, split into its parts
        (dpprof.stepmodel.partition over the run's phases): rank, step, window_ms, a column a part and the rest; empty
        without phases. Computed once, at the first rule that reads it (outlier_steps, unrecorded_time): the rules
        read the same frame and change neither it nor the tables."""
        steps = self.steps[self.steps["step"] != self.first_step]
        if steps.empty or self.phases.empty:
            return pd.DataFrame()
        windows = pd.DataFrame({"rank": steps["rank"], "step": steps["step"], "lo": steps["start_ms"],
                                "hi": steps["start_ms"] + steps["duration_ms"]})
        ph = self.phases
        intervals = pd.DataFrame({"rank": ph["rank"], "step": ph["step"], "kind": ph["phase"], "start": ph["start_ms"],
                                  "end": ph["start_ms"] + ph["duration_ms"]})
        return partition(windows, intervals, parts_for(self.model.phases), ["rank", "step"])


def split_script_comms(comms: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A comms table as (DDP's or FSDP's collectives, or an imported trace's; the script's own collectives): the figures
    of buckets and of FSDP's collectives read the first alone. The table itself where the script called none."""
    if comms.empty or "bucket" not in comms:
        return comms, comms.iloc[:0]
    own = comms["bucket"].to_numpy() == SCRIPT_BUCKET
    if not own.any():
        return comms, comms.iloc[:0]
    return comms[~own], comms[own]


def finding(kind: str, severity: str, device: str | None, title: str, evidence: str, advice: str,
            value: float | None, unit: str | None) -> dict:
    """One finding row (FindingRecord's fields); ``unit`` says what ``value`` is (a key of FINDING_UNITS; both None
    for a finding with no figure)."""
    why = finding_unit_error(value, unit)
    if why is not None:
        raise ValueError(why)
    return dict(kind=kind, severity=severity, device=device, title=title, evidence=evidence, advice=advice,
                value=None if value is None else float(value), unit=unit)


def per_step(t: Tables, names: tuple[str, ...] | list[str]) -> pd.DataFrame:
    """Milliseconds of the named phases per step (rows, the first step left out) and device (columns), forward
    calls summed."""
    sel = t.phases[t.phases["phase"].isin(names) & (t.phases["step"] != t.first_step)]
    return sel.groupby(["step", "device"])["duration_ms"].sum().unstack("device")
