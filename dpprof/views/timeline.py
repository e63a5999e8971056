"""The Timeline page of one run: a per-device Gantt of the phases over a chosen range of steps."""
from __future__ import annotations

import pandas as pd

from dpprof.loaders import none_iterated
from dpprof.store import detail_rows, queries
from dpprof.store.reader import StoredRun

__all__ = ["TIMELINE_DEFAULT_STEPS", "STREAM_PHASE", "step_bounds", "default_timeline_range", "timeline", "lanes_text",
           "detail_gaps"]

TIMELINE_DEFAULT_STEPS = 5  # a few steps show each phase wide enough to read
STREAM_PHASE = "kernels"  # the phase of a GPU stream lane's spans (dpprof.store.detail_rows.stream_spans)


def step_bounds(run: StoredRun) -> tuple[int | None, int | None]:
    """The run's first and last recorded step (None, None before its first step)."""
    return queries.step_span(run)


def default_timeline_range(run: StoredRun) -> tuple[int, int]:
    """The last TIMELINE_DEFAULT_STEPS steps (all steps of a shorter run)."""
    first, last = step_bounds(run)
    if first is None or last is None:
        return 0, 0
    return max(first, last - TIMELINE_DEFAULT_STEPS + 1), last


def timeline(run: StoredRun, first_step: int, last_step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phases and steps of a range of steps (see dpprof.store.queries.timeline), and, where the run kept its GPU
    streams (an imported trace with kernels), a lane per stream: phase STREAM_PHASE, device "cuda:0 stream 7",
    each span a stream's kernels less than dpprof.trace.detail.STREAM_MERGE_SHARE of the step apart."""
    phases, steps = queries.timeline(run, first_step, last_step)
    last_step = min(last_step, first_step + queries.TIMELINE_MAX_STEPS - 1)
    spans = detail_rows.stream_spans(run, first_step, last_step)
    if spans.empty:
        return phases, steps
    lanes = pd.DataFrame({"step": spans["step"].astype(int), "call": 0, "phase": STREAM_PHASE,
                          "device": [f"{d} stream {s}" for d, s in zip(spans["device"], spans["stream"])],
                          "start_ms": spans["start_ms"], "duration_ms": spans["duration_ms"]})
    lanes["end_ms"] = lanes["start_ms"] + lanes["duration_ms"]
    return pd.concat([phases, lanes[phases.columns]], ignore_index=True), steps


def detail_gaps(run: StoredRun, first_step: int, last_step: int) -> str | None:
    """Where a range of steps holds only aggregates (a long run's thinned detail), in one sentence; None when
    every step of the range kept its detail."""
    model = run.model
    retention = model.retention
    if not model.thinned or retention is None:  # a thinned run has its retention: the test is for mypy
        return None
    last_step = min(last_step, first_step + queries.TIMELINE_MAX_STEPS - 1)
    kept = set(queries.detail_steps(run, first_step, last_step))
    missing = [s for s in range(first_step, last_step + 1) if s not in kept]
    if not missing:
        return None
    shown = len(kept)
    return (f"Steps {first_step}–{last_step}: {len(missing)} of {last_step - first_step + 1} hold only their step "
            f"time and the aggregates (this run keeps full detail for the first {retention.first_steps:,} steps, "
            f"one in {retention.every}, outliers and their neighbours, peaks and steps "
            f"{model.detail_from:,} on); {shown} shown in full.")


def lanes_text(run: StoredRun) -> str:
    """What the Timeline's lanes are, in the run's terms."""
    model = run.model
    streams = (" Below them, each GPU stream's kernels (kernels close together drawn as one bar; hover for its "
               "kernels and their time).") if model.kind == "trace_gpu" else ""
    if model.dataparallel:
        return ("Lanes: each step; parallel_apply (every replica together); then each device with its own phases "
                "(scatter, replicate and gather on the output device, each replica's apply on its own)." + streams)
    unit = "rank" if model.unit == "rank" else "process"
    # recorded with no DataLoader iterated (dpprof.loaders): the data part is the script's own work before forward
    data = ("the time before forward (data: no DataLoader ran, the script's own work)"
            if none_iterated(run.data_loaders()) else "loading the batch (data)")
    if model.fsdp_phases:  # FSDP's own waits and copies inside forward and backward, no all-reduce
        return (f"Lanes: each step; then each {unit} with its phases in order: {data}, forward and "
                "backward with FSDP's work inside them (the waits for its all-gathers and reduce-scatters, its "
                "copy-in and copy-out) and the optimizer step." + streams)
    return (f"Lanes: each step; then each {unit} with its phases in order: {data}, forward, "
            "backward (its compute, then the wait for the gradient all-reduce where recorded) and the optimizer "
            "step." + streams)
