"""Findings: what stands out in a run, the numbers that show it, what it costs, and what to do.

One entry point, ``run_findings(run)``, takes a run opened for reading (dpprof.store.StoredRun) and runs the
rules of its kind (``rules_for``) on its tables:

| kind (run.model.kind) | rules |
| --- | --- |
| dataparallel, balanced | DATAPARALLEL_RULES: straggler, memory skew, the DataParallel tax, uneven and idle chunks, under-used and throttled GPUs, backward's share, outlier steps |
| ddp | PROCESS_RULES: straggler rank, all-reduce share and buckets, uneven inputs, under-used and throttled GPUs, outlier steps |
| fsdp | FSDP_RULES_OF_RUN: straggler rank, all-gather and reduce-scatter exposed, reshard-after-forward, uneven shards, uneven inputs, under-used and throttled GPUs, outlier steps |
| trace_gpu, trace_cpu | DATAPARALLEL_RULES for a trace of dpprof.DataParallel, FSDP_RULES_OF_RUN for a trace of an FSDP run dpprof exported (its FSDP phases), else PROCESS_RULES; with GPUs also TRACE_GPU_RULES (idle GPUs, DataParallel on several GPUs) and, where the shared rules found nothing of their kind, the GPU-side communication share and the allocator's skew |
| every kind but empty | DETAIL_RULES (dpprof.findings.detail): data loading's share of the step; from a trace's or a capture's operators, kernels and memory, low GPU utilization, tensor-core-eligible work without tensor cores, peak memory near the GPU's capacity |
| empty | none |

A straggler or memory finding on a run with operator data names the operators behind it (findings.detail.explain).

Each finding is raised and graded only above named floors (dpprof.findings.floors and each rule module's
thresholds, with their reasons). Pure functions of the tables: no plotting, no I/O but reading the run.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dpprof.findings.base import FINDING_COLUMNS, Tables, finding
from dpprof.findings.dataparallel import (BACKWARD_SHARE_INFO, DP_TAX_WARN, MEMORY_SKEW_CRITICAL_RATIO,
                                          MEMORY_SKEW_RATIO, STRAGGLER_CONSISTENCY, STRAGGLER_RATIO,
                                          STRAGGLER_RATIO_CPU, UNEVEN_STEPS_SHARE, DataParallelTax, Straggler,
                                          backward_share, dataparallel_tax, dataparallel_tax_of, memory_skew, straggler, straggler_severity,
                                          straggler_verdict, uneven_chunks)
from dpprof.findings.ddp import (COMM_SHARE_WARN, FEW_BUCKETS, MANY_BUCKETS, SMALL_BUCKET_BYTES, communication,
                                 straggler_rank, uneven_inputs)
from dpprof.findings.detail import (DATA_SHARE_WARN, DETAIL_RULES, GPU_UTIL_LOW_PCT, MEMORY_FULL_SHARE,
                                    SUPERSEDES, TC_UNUSED_SHARE, explain, operator_data)
from dpprof.findings.fsdp import FSDP_RULES
from dpprof.findings.floors import (CRITICAL_STEP_SHARE, MEMORY_FLOOR_BYTES, STEP_SHARE_FLOOR, TIME_FLOOR_MS,
                                    Imbalance, imbalance, worth_bytes, worth_time)
from dpprof.findings.gpu import (GPU_IDLE_WARN, THROTTLED_SAMPLES_SHARE, UNDERUSED_UTIL_RATIO, allocator_skew,
                                 gpu_communication, gpu_idle, gpu_underused, throttling, use_ddp)
from dpprof.findings.steps import (OUTLIER_STEP_RATIO, OUTLIER_TIME_SHARE, between_steps, outlier_steps,
                                   unrecorded_time)
from dpprof.records import DP_TAX_PHASES, FINDING_UNITS, SEVERITIES
from dpprof.store import finding_rows, queries
from dpprof.store.model import RunModel
from dpprof.store.reader import StoredRun

__all__ = ["FINDING_COLUMNS", "FINDINGS_MIN_STEPS", "FINDINGS_FULL_STEPS", "Findings", "Tables", "Rule",
           "DATAPARALLEL_RULES", "PROCESS_RULES", "FSDP_RULES_OF_RUN", "TRACE_GPU_RULES", "FALLBACK_RULES", "rules_for", "run_findings",
           "findings_from", "worst_first", "tables_of", "findings_withheld", "finding", "imbalance", "Imbalance", "Straggler",
           "DataParallelTax",
           "straggler_verdict", "worth_time",
           "worth_bytes", "TIME_FLOOR_MS", "STEP_SHARE_FLOOR", "MEMORY_FLOOR_BYTES", "CRITICAL_STEP_SHARE",
           "STRAGGLER_RATIO", "STRAGGLER_RATIO_CPU", "STRAGGLER_CONSISTENCY", "straggler_severity",
           "MEMORY_SKEW_RATIO", "MEMORY_SKEW_CRITICAL_RATIO", "DP_TAX_WARN", "UNEVEN_STEPS_SHARE",
           "BACKWARD_SHARE_INFO", "COMM_SHARE_WARN", "FEW_BUCKETS", "MANY_BUCKETS", "SMALL_BUCKET_BYTES",
           "GPU_IDLE_WARN", "UNDERUSED_UTIL_RATIO", "THROTTLED_SAMPLES_SHARE", "OUTLIER_STEP_RATIO",
           "OUTLIER_TIME_SHARE", "DETAIL_RULES", "DATA_SHARE_WARN", "GPU_UTIL_LOW_PCT", "TC_UNUSED_SHARE",
           "MEMORY_FULL_SHARE"]

Rule = Callable[[Tables], list[dict]]

# No findings from fewer steps than this: the first step carries one-time costs (threads started,
# memory allocated, lazy initialisation), and the straggler rule needs three steps to call a device
# consistently slow. A run that failed after one step says nothing about balance.
FINDINGS_MIN_STEPS = 3
# Up to this many steps, findings come from every record (well under a second); beyond it a finished
# run gives the findings stored when it closed, and a running one those of its last this-many steps.
FINDINGS_FULL_STEPS = 5_000

DATAPARALLEL_RULES: tuple[Rule, ...] = (straggler, memory_skew, dataparallel_tax, uneven_chunks, gpu_underused,
                                        throttling, backward_share, outlier_steps, between_steps)
PROCESS_RULES: tuple[Rule, ...] = (straggler_rank, communication, uneven_inputs, gpu_underused, throttling,
                                   outlier_steps, unrecorded_time, between_steps)
# An FSDP rank's: the collectives in FSDP's own terms (dpprof.findings.fsdp) in place of DDP's all-reduce share
FSDP_RULES_OF_RUN: tuple[Rule, ...] = (straggler_rank, *FSDP_RULES, uneven_inputs, gpu_underused, throttling,
                                       outlier_steps, unrecorded_time, between_steps)
TRACE_GPU_RULES: tuple[Rule, ...] = (gpu_idle, use_ddp)
# Rules of an imported trace's GPUs that say what a shared rule may already have said from the host's view:
# each runs only when no finding of the kind named was raised.
FALLBACK_RULES: tuple[tuple[Rule, str], ...] = ((gpu_communication, "communication_share"),
                                                (allocator_skew, "memory_skew"))


@dataclass
class Findings:
    """A run's findings, worst first, and where they come from in words."""

    table: pd.DataFrame  # FINDING_COLUMNS
    scope: str  # "from all 20 steps", "stored when the run finished, ...", or why there are none
    withheld: bool = False  # True when the run has too few steps (scope says so)
    # the verdict on the slowest device, from the tables the rules read (None: one device, or under 3 steps): the
    # straggler finding is raised from it, and the Overview's headline says it
    straggler: Straggler | None = None
    # the DataParallel tax per step past the first, from the same tables (None: not a DataParallel run, or no step past
    # the first): the tax finding states it, the Overview's section and Compare say it
    tax: DataParallelTax | None = None


def rules_for(model: RunModel) -> tuple[tuple[Rule, ...], tuple[tuple[Rule, str], ...]]:
    """The rules a run of this kind runs, and its fallback rules (see the module's table)."""
    if model.kind == "empty":
        return (), ()
    # an FSDP run's, recorded or read back from the trace dpprof exported of it (RunModel.fsdp_phases)
    steps_kind = FSDP_RULES_OF_RUN if model.fsdp_phases else DATAPARALLEL_RULES if model.dataparallel else PROCESS_RULES
    base = steps_kind + DETAIL_RULES
    if model.kind == "trace_gpu":
        return base + TRACE_GPU_RULES, FALLBACK_RULES
    return base, ()


def tables_of(run: StoredRun, last_steps: int | None = None, work_only: bool = False) -> Tables:
    """The run's tables for the rules: every row, or those of its last ``last_steps`` steps.

    A run read from its aggregates (a long one, or one whose detail was thinned: dpprof.store.retention) gives
    every step's time, and the phases and all-reduces of the steps whose detail stands for the run without bias
    (RunModel.sample_ranges, applied in dpprof.store.finding_rows: one step in ``every``), not the outliers kept for
    their own sake, with those steps' times; every step's time is ``all_steps``; its memory and allocator rows include
    each device's peak step.
    ``work_only``: the steps and the work phases (run.model.work) alone, and a DataParallel run's scatter, replicate and
    gather, the rest empty: what straggler_verdict and dataparallel_tax_of read.
    """
    names = ("steps", "phases", "memory", "allocator", "comms", "gpu_time")
    kinds: dict[str, Any] = {}
    if work_only and last_steps is None:
        frames = {t: finding_rows.empty(run, t) for t in (*names, "gpu_samples")}
        frames["steps"] = finding_rows.sampled(run, "steps")
        phases = (*run.model.work.phases, *(DP_TAX_PHASES if run.model.dataparallel else ()))
        frames["phases"] = finding_rows.sampled_phases(run, phases)
        return Tables(model=run.model, traced_dataparallel=(run.meta.get("workload_args") or {}).get("dataparallel"),
                      step_count=run.model.steps, detail=operator_data(run), **frames)
    if last_steps is None and not run.model.aggregated:
        frames = {t: run.table(t) for t in (*names, "gpu_samples")}
    elif last_steps is None:
        frames = {t: finding_rows.sampled(run, t) for t in (*names, "gpu_samples")}
        frames["all_steps"] = run.table("steps")
        # a thinned run of training and evaluation steps: their phases do not tell every step's kind, the writer's
        # medians of each kind and the kept steps' kinds do (dpprof.findings.steps.thinned_kinds)
        medians = queries.kind_medians(run)
        if medians is not None:
            kinds = {"kind_medians": medians, "kept_trained": finding_rows.kept_steps_trained(run)}
    else:
        last = finding_rows.last_step(run)
        lo = -1 if pd.isna(last) else int(last) - last_steps + 1
        frames = {t: finding_rows.from_step(run, t, lo) for t in names}
        t0 = frames["steps"]["start_ms"].min() if not frames["steps"].empty else 0.0
        frames["gpu_samples"] = finding_rows.gpu_samples_from(run, t0)
    return Tables(model=run.model, traced_dataparallel=(run.meta.get("workload_args") or {}).get("dataparallel"),
                  detail=operator_data(run), data_loaders=run.data_loaders(), **frames, **kinds)


def findings_from(tables: Tables) -> pd.DataFrame:
    """Every rule of the run's kind on these tables: the findings, worst first (severity, then value)."""
    rules, fallbacks = rules_for(tables.model)
    rows = [row for rule in rules for row in rule(tables)]
    for rule, kind in fallbacks:
        if not any(r["kind"] == kind for r in rows):
            rows += rule(tables)
    for first, second in SUPERSEDES.items():  # one finding a device for one figure
        said = {r["device"] for r in rows if r["kind"] == first}
        rows = [r for r in rows if not (r["kind"] == second and r["device"] in said)]
    rows = explain(rows, tables)
    df = pd.DataFrame(rows, columns=FINDING_COLUMNS)
    if df.empty:
        return df
    return worst_first(df)


def worst_first(df: pd.DataFrame) -> pd.DataFrame:
    """Findings worst first: by severity, then by unit in FINDING_UNITS' order (a share of the step before a ratio,
    milliseconds, bytes or a count, which cannot be set against each other: 1.8x is not more than 0.3 of a step),
    then by value, largest first, among the findings of one unit; findings without a value last in their severity."""
    order = {u: i for i, u in enumerate(FINDING_UNITS)}
    keys = pd.DataFrame({"severity": df["severity"].map({s: i for i, s in enumerate(SEVERITIES)}),
                         "unit": df["unit"].map(order).fillna(len(order)), "value": -df["value"].astype(float)})
    ranked = keys.sort_values(["severity", "unit", "value"], na_position="last", kind="stable").index
    return df.loc[ranked].reset_index(drop=True)


def findings_withheld(steps: int) -> str | None:
    """Why a run of ``steps`` steps gives no findings (too few), or None when findings can be computed."""
    if steps >= FINDINGS_MIN_STEPS:
        return None
    return (f"no findings from {steps} step{'s' if steps != 1 else ''}: they need at least {FINDINGS_MIN_STEPS} "
            "(the first step carries one-time costs, and a device is called slow only when it is slow step "
            "after step)")


def run_findings(run: StoredRun, fresh: bool = False) -> Findings:
    """The run's findings and where they come from: computed from every step up to FINDINGS_FULL_STEPS steps
    (or when ``fresh``); beyond, those stored when a finished run closed, or those of a running run's last
    FINDINGS_FULL_STEPS steps.

    Example:
        >>> found = run_findings(dpprof.load_run("20261122-080557"))
        >>> found.table[["severity", "title"]], found.scope
    """
    model = run.model
    empty = pd.DataFrame(columns=FINDING_COLUMNS)
    if model.kind == "empty":
        return Findings(empty, model.empty_reason or "no steps recorded", withheld=True)

    def tax(tables: Tables) -> DataParallelTax | None:
        return dataparallel_tax_of(tables) if model.dataparallel else None

    withheld = findings_withheld(model.steps)
    if withheld:
        return Findings(empty, withheld, withheld=True, tax=tax(tables_of(run)) if model.dataparallel else None)
    running = run.meta["status"] == "running"
    if fresh or model.steps <= FINDINGS_FULL_STEPS:
        tables = tables_of(run)
        return Findings(findings_from(tables), f"from all {model.steps:,} steps" + (" so far" if running else ""),
                        straggler=straggler_verdict(tables), tax=tax(tables))
    if run.meta["status"] == "finished":
        stored = worst_first(run.findings[FINDING_COLUMNS]) if len(run.findings) else empty  # as written, or older
        # the verdict and the tax from the same steps and phases the stored findings read (tables_of): the work phases
        # and the tax's alone
        tables = tables_of(run, work_only=True)
        return Findings(stored, f"stored when the run finished, from all {model.steps:,} steps",
                        straggler=straggler_verdict(tables), tax=tax(tables))
    tables = tables_of(run, FINDINGS_FULL_STEPS)
    return Findings(findings_from(tables), f"from the last {FINDINGS_FULL_STEPS:,} of {model.steps:,} steps",
                    straggler=straggler_verdict(tables), tax=tax(tables))
