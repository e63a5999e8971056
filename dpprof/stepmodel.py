"""One model of a step: an interval whose parts partition it.

A step is an interval [start, end). What ran in it (phases on the host, kernels and copies on a GPU) is a set of
intervals of named kinds that may overlap each other (an all-reduce during backward, a copy during a kernel) and
may reach past the step (a collective still running when the next step starts). The step's parts are found the
way the TensorBoard profiler plugin split a step: every instant of the step is given to the first part, in a
stated priority, whose kinds are all running then; an instant where none runs is the step's rest (the host's
"rest", a GPU's "idle"). The parts therefore sum to the step, none exceeds it, and an overlap is counted once.

| kind of step | priority (first wins) | rest |
| --- | --- | --- |
| DataParallel (dpprof's phases) | scatter, replicate, parallel_apply, apply (one device's, outside any parallel_apply), gather, loss, reduce, backward | rest |
| a process (DDP ranks, imported traces) | forward, backward_compute, comm_wait, optimizer, script_comm, data | rest |
|   (a process whose backward is not split) | forward, backward, optimizer, script_comm, data | rest |
| an FSDP rank | all_gather_wait, reduce_scatter_wait, copy_in, copy_out, forward, backward, optimizer, script_comm, data | rest |
| a GPU (imported traces) | overlap (kernel + collective), computation, communication, memcpy, memset | idle |

Every figure that says "N% of the step" or stacks parts of a step is read from ``partition``; nothing sums
raw durations that may overlap.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dpprof.records import ALL_REDUCE

__all__ = ["Part", "DATAPARALLEL_PARTS", "PROCESS_PARTS", "FSDP_PARTS", "GPU_PARTS", "REST", "IDLE", "SHARED_PARTS", "SHARED_OF",
           "PHASE_WORDS", "SHARED_PART_WORDS", "parts_for", "part_names", "partition", "partition_one"]

Part = tuple[str, tuple[str, ...]]  # (part name, the kinds that must all be running for an instant to be it)
REST = "rest"  # the part of a host step no phase covers: Python between phases, what no range marks
IDLE = "idle"  # the part of a GPU's step window where it ran nothing

# DataParallel's phases follow one another on the output device; each device's apply runs inside
# parallel_apply, which takes its instants first. On one device torch's DataParallel calls the module itself,
# with no parallel_apply around it: that apply is then a part of the step of its own (it was counted as rest).
DATAPARALLEL_PARTS: tuple[Part, ...] = tuple((p, (p,)) for p in (
    "scatter", "replicate", "parallel_apply", "apply", "gather", "loss", "reduce", "backward"))
# A process's step (a DDP rank, an imported trace): computing first, then the all-reduce it waits for (what
# overlapped backward compute is counted as compute: only the exposed wait is communication), the optimizer, and
# the script's own collectives (a recorded rank's wait in a metric's all-reduce between its steps, inside the gap before
# forward), and loading data last (a DataLoader range that runs beside forward is not time the step spent waiting for
# data). The data part is the DataLoader's calls in that gap (a trace's DataLoader ranges, a recorded rank's timed
# calls: dpprof.loaders), else the whole gap. "backward" is backward_compute + comm_wait (its parent): a part of its own only in a
# run without its parts.
PROCESS_PARTS: tuple[Part, ...] = tuple((p, (p,)) for p in (
    "forward", "backward_compute", "comm_wait", "backward", "optimizer", "script_comm", "data"))
# An FSDP rank (dpprof.parallel.fsdp): its forward and backward hold FSDP's own work, so the exposed collectives and
# FSDP's copies come first; what is left of forward and backward is their compute.
FSDP_PARTS: tuple[Part, ...] = tuple((p, (p,)) for p in (
    "all_gather_wait", "reduce_scatter_wait", "copy_in", "copy_out", "forward", "backward", "optimizer", "script_comm",
    "data"))
# A GPU: kernels over copies over memsets (the plugin's kernel > memcpy > memset > communication order); a
# compute kernel and a collective kernel running together are the overlap, a part of its own.
GPU_PARTS: tuple[Part, ...] = (("overlap", ("compute", "communication")), ("computation", ("compute",)),
                               ("communication", ("communication",)), ("memcpy", ("memcpy",)),
                               ("memset", ("memset",)))


# One vocabulary for every kind, so runs of different kinds compare part by part (Compare, summaries): what each
# kind's parts are in it.
SHARED_PARTS = ("compute", "exposed communication", "data", "optimizer", "DataParallel tax", REST)
SHARED_OF = {
    "scatter": "DataParallel tax", "replicate": "DataParallel tax", "gather": "DataParallel tax",  # records.DP_TAX_PHASES
    "parallel_apply": "compute", "apply": "compute", "loss": "compute", "reduce": "compute", "backward": "compute",
    "forward": "compute", "backward_compute": "compute", "comm_wait": "exposed communication",
    "optimizer": "optimizer", "data": "data", REST: REST,
    "all_gather_wait": "exposed communication", "reduce_scatter_wait": "exposed communication",
    "copy_in": "compute", "copy_out": "compute", "script_comm": "exposed communication",
}

# The words for a phase whose name is not one, wherever a phase is named for people (charts' legends, dpprof advise,
# the advisor's notes). A place that says more about a phase (a legend's "loss (output device)") adds to these.
PHASE_WORDS = {"parallel_apply": "apply (all devices)", "backward_compute": "backward compute",
               "comm_wait": f"{ALL_REDUCE} wait", "all_gather_wait": "all-gather wait",
               "reduce_scatter_wait": "reduce-scatter wait", "copy_in": "FSDP copy-in", "copy_out": "FSDP copy-out",
               "script_comm": "the script's collectives"}
# The shared parts as a sentence names them (Compare's differences); the others by their own names.
SHARED_PART_WORDS = {REST: "the rest of the step", "exposed communication": "exposed communication (the wait for it)",
                     "DataParallel tax": "the DataParallel tax (scatter + replicate + gather)"}


def parts_for(phases: Sequence[str]) -> tuple[Part, ...]:
    """The host parts of a run with these phases: a process's when it has forward but no apply, else
    DataParallel's; only the parts whose phase the run recorded."""
    process = "forward" in phases and "apply" not in phases
    if process and any(p in phases for p, _ in FSDP_PARTS[:4]):  # records.FSDP_ONLY_PHASES
        return tuple(p for p in FSDP_PARTS if set(p[1]) <= set(phases))
    table = PROCESS_PARTS if process else DATAPARALLEL_PARTS
    split = process and "backward_compute" in phases  # backward is its parts
    # apply is a part only where no parallel_apply holds it (one device): a long run's block sums never overlap
    inside = not process and "parallel_apply" in phases
    return tuple(p for p in table if set(p[1]) <= set(phases) and not (split and p[0] == "backward")
                 and not (inside and p[0] == "apply"))


def part_names(parts: Sequence[Part], rest: str = REST) -> list[str]:
    """The parts' names in priority order, then the rest."""
    return [name for name, _ in parts] + [rest]


def partition(windows: pd.DataFrame, intervals: pd.DataFrame, parts: Sequence[Part], keys: Sequence[str],
              rest: str = REST) -> pd.DataFrame:
    """Each window split into ``parts`` by priority, in ms: the columns sum to the window's length.

    Args:
        windows: one row per step (or step and device): the ``keys`` columns, ``lo`` and ``hi`` (ms).
        intervals: what ran: the ``keys`` columns (naming its window), ``kind``, ``start`` and ``end`` (ms).
            Intervals are clipped to their window; kinds no part names are ignored; one with no window is ignored.
        parts: (name, kinds) in priority order: an instant belongs to the first part whose kinds all run then.
        keys: the columns that name a window.
        rest: the name of what no part covers.

    Returns:
        the windows' ``keys``, ``window_ms`` (hi - lo) and one column per part then ``rest``, in window order.
    """
    keys = list(keys)
    names = part_names(parts, rest)
    out = windows[keys].reset_index(drop=True).copy()
    lo = windows["lo"].to_numpy(dtype=float)
    hi = np.maximum(windows["hi"].to_numpy(dtype=float), lo)
    out["window_ms"] = hi - lo
    n_windows = len(windows)
    kinds = sorted({k for _, ks in parts for k in ks})
    kind_of = {k: i for i, k in enumerate(kinds)}
    iv = intervals[intervals["kind"].isin(kinds)] if len(intervals) else intervals
    if n_windows == 0:
        return out.assign(**{n: np.zeros(0) for n in names})
    if len(iv):
        position = pd.Series(np.arange(n_windows), index=pd.MultiIndex.from_frame(windows[keys]) if len(keys) > 1
                             else pd.Index(windows[keys[0]]))
        where = (position.reindex(pd.MultiIndex.from_frame(iv[keys])) if len(keys) > 1
                 else position.reindex(pd.Index(iv[keys[0]]))).to_numpy()
        known = ~np.isnan(where.astype(float))
        w = where[known].astype(np.int64)
        start = np.maximum(iv["start"].to_numpy(dtype=float)[known], lo[w])
        end = np.minimum(iv["end"].to_numpy(dtype=float)[known], hi[w])
        k = iv["kind"].map(kind_of).to_numpy()[known].astype(np.int64)
        keep = end > start
        w, start, end, k = w[keep], start[keep], end[keep], k[keep]
    else:
        w = start = end = k = np.empty(0, dtype=np.int64)
    # a sweep over every window at once: each interval adds one to its kind's count at its start and takes it away
    # at its end; the windows' own bounds are events that change nothing, so every instant of a window lies
    # between two events of that window
    ev_w = np.concatenate([w, w, np.arange(n_windows), np.arange(n_windows)])
    ev_t = np.concatenate([start, end, lo, hi]).astype(float)
    ev_k = np.concatenate([k, k, np.zeros(2 * n_windows, dtype=np.int64)])
    ev_d = np.concatenate([np.ones(len(w)), -np.ones(len(w)), np.zeros(2 * n_windows)])
    order = np.lexsort((ev_t, ev_w))
    ev_w, ev_t, ev_k, ev_d = ev_w[order], ev_t[order], ev_k[order], ev_d[order]
    delta = np.zeros((len(ev_t), max(1, len(kinds))))
    delta[np.arange(len(ev_t)), ev_k] = ev_d
    running = np.cumsum(delta, axis=0) > 0.5  # every interval ends in its own window: counts return to 0 at its end
    seg_ms = np.diff(ev_t)
    same = ev_w[1:] == ev_w[:-1]
    state = running[:-1]
    match = [np.all(state[:, [kind_of[x] for x in ks]], axis=1) for _, ks in parts]
    match.append(np.ones(len(state), dtype=bool))
    owner = np.argmax(np.column_stack(match), axis=1)
    seg_w, owner, seg_ms = ev_w[:-1][same], owner[same], seg_ms[same]
    sums = np.bincount(seg_w * len(names) + owner, weights=seg_ms, minlength=n_windows * len(names))
    sums = sums.reshape(n_windows, len(names))
    for i, name in enumerate(names):
        out[name] = sums[:, i]
    return out


def partition_one(lo: float, hi: float, intervals: Sequence[tuple[str, float, float]], parts: Sequence[Part],
                  rest: str = REST) -> dict[str, float]:
    """One window's parts (``partition`` for a single step): {part: ms}, the rest last.

    Example:
        >>> partition_one(0, 10, [("compute", 0, 6), ("communication", 4, 12)], GPU_PARTS, IDLE)["overlap"]
        2.0
    """
    iv = pd.DataFrame(intervals, columns=["kind", "start", "end"]).assign(key=0)
    row = partition(pd.DataFrame({"key": [0], "lo": [lo], "hi": [hi]}), iv, parts, ["key"], rest).iloc[0]
    return {n: float(row[n]) for n in part_names(parts, rest)}
