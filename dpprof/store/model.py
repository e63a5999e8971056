"""What a stored run is and what it holds, read once: its kind, its device axis, its measurements.

Every reader of a run (the findings, the views, ``dpprof show`` and ``dpprof export``) asks this object
instead of guessing from phase names or table shapes. ``StoredRun.model`` builds it on first use with a
few index lookups (the phase names present, whether each table has a row), never a scan of a long run.

Kinds:

| kind | what | its terms |
| --- | --- | --- |
| ``dataparallel`` | dpprof.DataParallel on CPU workers or GPUs | apply per device, the DataParallel tax |
| ``balanced`` | DataParallelModel + DataParallelCriterion | apply per device, nothing gathered |
| ``ddp`` | DistributedDataParallel, one file per rank | forward + backward compute per rank, all-reduce |
| ``fsdp`` | FSDP2 (fully_shard) or FSDP1 (FullyShardedDataParallel), one file per rank | forward + backward per rank, all-gather, reduce-scatter |
| ``trace_gpu`` | an imported torch.profiler trace with GPU activity | host phases, GPU time per GPU |
| ``trace_cpu`` | an imported trace of a CPU-only process | host phases only |
| ``empty`` | no step recorded; ``empty_reason`` says why | |
"""
from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpprof.plaintext import capitalized
from dpprof.records import FSDP_ONLY_PHASES, HOST_OUTPUT, PHASE_ORDER, device_key
from dpprof.store.faults import RunFileError
from dpprof.store.retention import Retention, stored_retention
from dpprof.store.schema import TABLES

if TYPE_CHECKING:
    from dpprof.store.reader import StoredRun

__all__ = ["KINDS", "KIND_TITLES", "MEASUREMENTS", "TRACE_SOURCE", "ROWS_READ_STEPS", "SAMPLE_MIN_STEPS", "Work",
           "RunModel", "describe", "present_phases", "distinct", "distributed_backend", "backend_label"]

KINDS = ("dataparallel", "balanced", "ddp", "fsdp", "trace_gpu", "trace_cpu", "empty")
KIND_TITLES = {
    "dataparallel": "DataParallel", "balanced": "DataParallel, balanced (DataParallelModel + DataParallelCriterion)",
    "ddp": "DistributedDataParallel", "fsdp": "FSDP", "trace_gpu": "imported torch.profiler trace",
    "trace_cpu": "imported torch.profiler trace (CPU only)", "empty": "no steps",
}
# What a run can hold besides its steps, each a table (dpprof.records.TABLE_OF) but "work": the phases that
# are each device's own share of a step (DataParallel's apply; a rank's forward and backward compute).
MEASUREMENTS = ("phases", "work", "memory", "allocator", "gpu_samples", "comms", "gpu_time")
TRACE_SOURCE = "trace"  # runs.source of a run imported from torch.profiler traces (dpprof import)
# Phases in the order a step runs them: DataParallel's, then a process's (DDP ranks, imported traces).
# Up to this many steps, a run with every row of detail is read from its rows (exact, and fast at this size);
# beyond, or once its detail has been thinned (dpprof.store.retention), from its per-block aggregates.
ROWS_READ_STEPS = 5_000
# A run read from its aggregates is read through one step in its retention's ``every`` where that is at least this
# many steps (RunModel.sample_ranges): enough for the findings' medians and shares, unbiased in time.
SAMPLE_MIN_STEPS = 30


@dataclass(frozen=True)
class Work:
    """Each device's own share of a step: the phases summed, and how pages and columns name them."""

    phases: tuple[str, ...]  # ("apply",), or a process's ("forward", "backward_compute")
    label: str  # "apply", "forward + backward compute"
    column: str  # prefix of the per-device summary's columns: "apply_mean_ms", "compute_mean_ms"


DATAPARALLEL_WORK = Work(("apply",), "apply", "apply")
# how to profile the threads that run a DataParallel's replicas: torch.profiler records only the calling thread
PROFILE_ALL_THREADS = "experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)"
# A process's work (a DDP rank, an imported trace): what it computes, whichever of the two it recorded.
PROCESS_WORK = Work(("forward", "backward_compute"), "forward + backward compute", "compute")
# An FSDP rank's: its forward and backward, which hold FSDP's exposed collectives and copies (the step partition,
# dpprof.stepmodel.FSDP_PARTS, separates them)
FSDP_WORK = Work(("forward", "backward"), "forward + backward (with FSDP's collectives inside)", "compute")


def distributed_backend(meta: dict) -> str | None:
    """The torch.distributed backend of a run ("gloo", "nccl"), where it was stored: a DDP recording's
    workload_args (dpprof.record under torch.distributed, ``dpprof profile --ddp``), an imported trace's
    distributedInfo; None for a run that was not distributed or did not say."""
    args = meta.get("workload_args") or {}
    info = args.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    found = args.get("backend") if meta.get("backend") == "rank" else None
    found = found or info.get("backend")
    return str(found).lower() if found else None


def backend_label(meta: dict) -> str | None:
    """What a run ran on, in a listing's words: "cpu", "cuda", "mixed"; for a DDP recording, whose device axis
    is its ranks, the torch.distributed backend ("gloo", "nccl"), or "DDP ranks" where it was not stored,
    never the axis' name "rank"."""
    backend = meta.get("backend")
    if backend == "rank":
        return distributed_backend(meta) or "DDP ranks"
    return backend


@dataclass(frozen=True)
class RunModel:
    """One run's kind, device axis and measurements (see the module's table of kinds)."""

    kind: str
    imported: bool  # read from a torch.profiler trace (dpprof import), not recorded live
    backend: str | None  # "cpu", "cuda", "rank" (DDP ranks), None before the first forward call
    steps: int
    phases: tuple[str, ...]  # the phase names recorded, in the order a step runs them
    work: Work
    devices: tuple[str, ...]  # the device axis: every device of the run, in device_ids (or rank) order
    idle: tuple[str, ...]  # devices of a DataParallel run that never got a chunk
    has: frozenset[str]  # the MEASUREMENTS with at least one row
    missing: dict[str, str] = field(default_factory=dict)  # measurement -> why this run has none, in one sentence
    empty_reason: str | None = None  # why a run has no steps
    retention: Retention | None = None  # the detail the run keeps; None: a file of schema 1, every row, no aggregates
    detail_from: int = 0  # every step from here on has all its detail rows (before it, only those retention keeps)
    aggregated: bool = False  # pages read the per-block aggregates (dpprof.store.blocks), not the rows
    world_size: int | None = None  # ranks in the torch.distributed job (None: not distributed, or not said)
    ranks: tuple[int, ...] = ()  # the job's ranks this run holds (a file each); () for one process
    dist_backend: str | None = None  # "gloo", "nccl" (distributed_backend); None where not distributed or not said
    sharded: bool = False  # an imported trace of a job sharded with FSDP (its FSDP ranges are in the trace)
    # a DDP run dpprof exported, imported again: its collectives are its gradient buckets' all-reduces, as recorded
    ddp_buckets: bool = False
    comm_hook: str | None = None  # a recorded DDP's communication hook, as the script registered it (its qualname)

    @property
    def fsdp_phases(self) -> bool:
        """Whether the run has FSDP's own phases (its waits and copies): a recorded FSDP run, or one that dpprof
        exported and imported again (an imported trace of FSDP); what its FSDP collectives table is made of."""
        return self.kind == "fsdp" or (self.sharded and bool(set(FSDP_ONLY_PHASES) & set(self.phases)))

    @property
    def named_collectives(self) -> bool:
        """Whether the run's collectives are said by what they are (an imported trace's: all-reduce, reduce-scatter,
        all-to-all...), not as DDP's gradient all-reduce (a recorded DDP run's, and one dpprof exported and imported
        again): the findings, ``show`` and the Overview word them alike."""
        return self.imported and not self.ddp_buckets

    @property
    def thinned(self) -> bool:
        """Whether some steps' detail rows were let go (a long run of detail "bounded")."""
        return self.retention is not None and self.retention.bounded and self.detail_from > 0

    @property
    def whole_from(self) -> int:
        """The step from which every step keeps its detail: where thinning stopped, or a long run kept whole's
        newest ``last_steps``."""
        r = self.retention
        if r is None:
            return 0
        return self.detail_from if self.thinned else max(r.first_steps, self.steps - r.last_steps)

    def sample_ranges(self, stop: int | None = None) -> tuple[range, ...]:
        """The steps below ``stop`` (default: the step count) whose detail stands for the run without bias, as
        ranges: the one rule of sampled_steps_sql and of the work distribution's sample. Every step of a run read
        from its rows; of one read from its aggregates, one step in the retention's ``every`` from the first step to
        the last (a systematic sample: each of its steps stands for the same span of the run, the first and newest
        no more than the thinned ones). A run whose sample would hold under SAMPLE_MIN_STEPS steps is read through
        every step it kept whole instead: its first steps, one in ``every`` between and its newest, which are then
        most of the run (at least (first_steps + last_steps) / (SAMPLE_MIN_STEPS x every) of it). Never the
        outliers and peaks kept for their own sake."""
        stop = self.steps if stop is None else stop
        r = self.retention
        if not self.aggregated or r is None:
            return (range(stop),)
        whole = self.whole_from
        if -(-self.steps // r.every) >= SAMPLE_MIN_STEPS:
            return (range(0, whole, r.every), range(whole + -whole % r.every, stop, r.every))
        return (range(min(r.first_steps, whole)), range(r.first_steps + -r.first_steps % r.every, whole, r.every),
                range(whole, stop))

    def sampled_steps_sql(self, column: str = "step") -> str:
        """An SQL condition on ``column`` (a step column: ``step``, ``p.step``) that holds for the steps of
        sample_ranges, however far the step numbers go (an imported trace's start at its first ProfilerStep's).
        For the store's readers only (dpprof.store.detail): callers outside the store ask those for rows."""
        if not re.fullmatch(r"(?:[A-Za-z_]\w*\.)?step", column):
            raise ValueError(f"sampled_steps_sql: column must be a step column such as 'step' or 'p.step', got {column!r}")
        if not self.aggregated or self.retention is None:
            return "1"
        # terms SQLite answers from the step index (its OR optimisation), never a scan of every row: the first
        # ranges' steps generated, and the last range (the newest steps, kept whole) from its start on
        *parts, last = self.sample_ranges()
        terms = [f"{column} IN (WITH RECURSIVE k(s) AS (SELECT {p.start} UNION ALL SELECT s + {p.step} FROM k WHERE "
                 f"s + {p.step} < {p.stop}) SELECT s FROM k)" for p in parts if p]
        tail = f"{column} >= {last.start}"
        terms.append(tail if last.step == 1 else f"({tail} AND {column} % {last.step} = 0)")
        return f"({' OR '.join(terms)})"

    def detail_text(self) -> str | None:
        """What detail the run keeps, in one sentence; None for a run that keeps every row."""
        r = self.retention
        if not self.thinned or r is None:  # a thinned run has its retention: the test is for mypy
            return None
        return (f"Full detail is kept for the first {r.first_steps:,} steps, one step in {r.every}, outlier steps "
                f"and their neighbours, each device's peak step and steps {self.detail_from:,} on; every step's "
                f"time and per-block aggregates of everything else.")

    @property
    def dataparallel(self) -> bool:
        """Whether the steps are DataParallel's phases (scatter, replicate, apply per device, ...): recorded or
        imported from a trace of dpprof.DataParallel."""
        return "apply" in self.phases

    @property
    def gathers(self) -> bool:
        """Whether outputs were gathered onto one device (DataParallel without the balanced criterion)."""
        return "gather" in self.phases

    @property
    def unit(self) -> str:
        """What one lane of the device axis is called: "rank" for DDP ranks, else "device"."""
        return "rank" if self.devices and all(d.startswith("rank:") for d in self.devices) else "device"

    @property
    def spread(self) -> tuple[str, ...]:
        """The devices the work was spread over: every device but the host an output was gathered onto
        (output_device -1, HOST_OUTPUT)."""
        return tuple(d for d in self.devices if d != HOST_OUTPUT)

    @property
    def title(self) -> str:
        """The kind in words, with where it ran: "DataParallel on 2 CPU workers", "DistributedDataParallel (gloo),
        2 ranks", "imported torch.profiler trace of DDP (nccl), rank 0 of 2"."""
        n = len(self.devices)
        if self.kind in ("dataparallel", "balanced") and self.devices:
            n = len(self.spread)
            where = {"cpu": "CPU worker", "cuda": "GPU"}.get(self.backend or "", "device") + ("s" if n != 1 else "")
            return f"{KIND_TITLES[self.kind]} on {n} {where}"
        dist = f" ({self.dist_backend})" if self.dist_backend else ""
        if self.kind in ("ddp", "fsdp"):
            # FSDP1 NO_SHARD: a sharded job whose ranks all-reduce their gradients as DDP's do (a run of DDP's kind)
            what = "FullyShardedDataParallel (NO_SHARD)" if self.kind == "ddp" and self.sharded else KIND_TITLES[self.kind]
            return f"{what}{dist}, {n} rank{'s' if n != 1 else ''}"
        if self.imported:
            what = ("DataParallel" if self.dataparallel else
                    f"{'FSDP' if self.sharded else 'DDP'}{dist}, {self.scope}" if self.ranks else
                    f"one process on {n} GPU{'s' if n != 1 else ''}" if self.kind == "trace_gpu" else
                    "one CPU process")
            return f"imported torch.profiler trace of {what}" + (", CPU only" if self.kind == "trace_cpu" and self.ranks
                                                                  else "")
        return KIND_TITLES[self.kind]

    @property
    def backend_label(self) -> str | None:
        """What the run ran on, in words (``backend_label`` of its meta): "cpu", "cuda", "gloo", "DDP ranks"."""
        if self.backend == "rank":
            return self.dist_backend or "DDP ranks"
        return self.backend

    @property
    def scope(self) -> str:
        """Which ranks of its job a distributed run holds: "rank 0 of 16", "ranks 0 and 1 of 128", "ranks 0-3"
        (no world size stored); "" for one process."""
        if not self.ranks:
            return ""
        r = sorted(self.ranks)
        listed = (f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]} and {r[1]}" if len(r) == 2 else
                  f"ranks {r[0]}-{r[-1]}" if r == list(range(r[0], r[-1] + 1)) else f"ranks {', '.join(map(str, r))}")
        if self.world_size and len(r) == self.world_size:
            return f"{len(r)} ranks" if len(r) > 1 else listed
        return f"{listed} of {self.world_size}" if self.world_size else listed

    @property
    def partial_job(self) -> bool:
        """Whether the run holds only some ranks of a distributed job (the others' traces were not imported)."""
        return bool(self.ranks) and (self.world_size is None or len(self.ranks) < self.world_size)

    @property
    def nothing_to_balance(self) -> str | None:
        """For a run of one device, rank or process, why it has nothing to balance, in one sentence; else None."""
        if len(self.devices) > 1 or self.kind == "empty":
            return None
        if self.partial_job:
            of = f"a {self.world_size}-rank job" if self.world_size else "a distributed job"
            held = self.scope.split(" of ")[0]
            why, how = (("the other ranks were not imported", "import the ranks' files together to compare them")
                        if self.imported else
                        ("the other ranks' files are not here", "dpprof merge gathers them from the machines that "
                                                                "wrote them"))
            return f"{capitalized(held)} of {of}; {why}, so there is nothing to balance it against ({how})."
        if self.kind == "trace_cpu":
            return "One process: nothing to balance."
        if self.kind == "trace_gpu":
            return "One GPU: nothing to balance."
        return f"One {self.unit}: nothing to balance."


def distinct(run: StoredRun, table: str, column: str) -> list[object]:
    """SELECT DISTINCT column FROM table, as a loose index scan: one index lookup per value when an index leads
    with the column (dpprof.store.schema.INDEXES), where DISTINCT would read every row."""
    return run.query(
        f"WITH RECURSIVE v(x) AS (SELECT MIN({column}) FROM {table} UNION ALL "
        f"SELECT (SELECT MIN({column}) FROM {table} WHERE {column} > x) FROM v WHERE x IS NOT NULL) "
        "SELECT x FROM v WHERE x IS NOT NULL")["x"].drop_duplicates().tolist()


def present_phases(run: StoredRun, aggregates: bool = False) -> list[str]:
    """The phase names this run recorded, in the order a step runs them (with ``aggregates``, also those of
    steps whose rows were thinned away)."""
    order = {p: i for i, p in enumerate(PHASE_ORDER)}
    if aggregates:  # every phase recorded has its block rows (whose key leads with the phase)
        from dpprof.store.blocks import WORK

        names = {str(p) for p in distinct(run, "phase_blocks", "phase") if p != WORK}
    else:
        names = set(map(str, distinct(run, "phases", "phase")))
    return sorted(names, key=lambda p: (order.get(p, len(order)), p))


def _nonempty_tables(run: StoredRun) -> set[str]:
    """The record tables with at least one row in any of the run's files (one EXISTS lookup each)."""
    found: set[str] = set()
    for path in run.paths:
        with run.connect(path) as con:  # a damaged table's usable rows (dpprof.store.validation)
            try:
                names = {r[0] for r in con.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'")}
                found |= {t for t in TABLES
                          if t in names and con.execute(f"SELECT EXISTS(SELECT 1 FROM {t})").fetchone()[0]}
            except sqlite3.DatabaseError as err:
                raise RunFileError(f"{path.name}: corrupt: {err}") from None
    return found


def _work(phases: list[str], kind: str) -> Work:
    """Each device's own share of a step in this kind's terms: DataParallel's apply; a process's forward and
    backward compute (whichever of the two it recorded; both where it recorded neither, said in ``missing``)."""
    # a profiled dpprof.DataParallel (its parallel_apply) is DataParallel's, its applies in the trace or not
    if ("apply" in phases or "parallel_apply" in phases or kind in ("dataparallel", "balanced")
            or (kind == "empty" and "forward" not in phases)):
        return DATAPARALLEL_WORK
    if kind == "fsdp" or set(FSDP_ONLY_PHASES) & set(phases):  # recorded, or dpprof's FSDP file read back
        return FSDP_WORK
    if "forward" in phases and "backward_compute" not in phases:
        return Work(("forward",), "forward", "compute")
    return PROCESS_WORK


def _kind(run: StoredRun, steps: int, phases: list[str]) -> str:
    if not steps:
        return "empty"
    if run.meta.get("source") == TRACE_SOURCE:
        return "trace_gpu" if run.meta.get("backend") == "cuda" else "trace_cpu"
    if run.meta.get("backend") == "rank" or ("forward" in phases and "apply" not in phases):
        return "fsdp" if set(FSDP_ONLY_PHASES) & set(phases) else "ddp"
    if "reduce" in phases or (run.meta.get("workload_args") or {}).get("balanced"):
        return "balanced"
    return "dataparallel"


def _notes(run: StoredRun, source: str) -> list[str]:
    notes = run.query("SELECT DISTINCT message FROM notes WHERE source = ? ORDER BY t_ms", (source,))
    return list(dict.fromkeys(notes["message"]))


def _empty_reason(run: StoredRun) -> str:
    said = _notes(run, "dpprof")
    if said:
        return said[0][0].upper() + said[0][1:] + "."
    status = run.meta.get("status")
    if status == "running":
        return "No step has finished yet: the run is recording."
    if run.meta.get("error"):
        return f"The run {status} before its first step finished: {str(run.meta['error']).splitlines()[-1]}"
    return "The run recorded no steps."


def _missing(run: StoredRun, kind: str, has: set[str], backend: str | None, work: Work) -> dict[str, str]:
    """Why the run lacks each measurement its kind could have, in one sentence each."""
    out: dict[str, str] = {}
    trace = kind.startswith("trace")
    if "memory" not in has:
        out["memory"] = ("An imported torch.profiler trace has no dpprof accounting of what each device holds (its "
                         "share of the batch, outputs, activations)." if trace else
                         "No memory records yet: no forward call has finished.")
    if "allocator" not in has:
        if trace:
            out["allocator"] = ("The trace has no [memory] events for a GPU (recorded without profile_memory=True, "
                                "or with no GPU), so there are no CUDA allocator figures.")
        elif backend == "cpu":
            out["allocator"] = ("CPU workers have no CUDA caching allocator: memory is what dpprof accounts to each "
                                "device (chunk, outputs, activations, gathered outputs, weights).")
        elif kind in ("ddp", "fsdp"):
            out["allocator"] = ("Ranks on CPUs have no CUDA caching allocator: memory is what dpprof accounts to "
                                "each rank.")
        else:
            out["allocator"] = "No CUDA allocator figures were recorded for this run."
    if "gpu_samples" not in has:
        noted = "; ".join(_notes(run, "nvml"))
        base = {"trace_gpu": "torch.profiler traces carry no NVML samples of the GPUs.",
                "trace_cpu": "A CPU-only trace has no GPUs to sample.",
                "ddp": ("No GPU samples were recorded for these ranks." if "allocator" in has else
                        "These ranks ran on CPUs (no CUDA allocator records): there are no GPUs to sample.")}.get(
            "ddp" if kind == "fsdp" else kind)
        if base is None:
            base = ("This run used CPU workers: there are no GPUs to sample." if backend == "cpu"
                    else "No GPU samples were recorded for this run.")
        out["gpu_samples"] = (base or "No GPU samples were recorded for these ranks.") + (
            f" The recorder noted: {noted}." if noted and not trace else "")
    if kind == "trace_cpu":  # one sentence for the GPU it never had: its samples and its time alike
        out["gpu_samples"] = "A CPU-only trace has no GPU: no GPU samples, kernels, copies or idle time."
    elif kind == "trace_gpu" and "gpu_time" not in has:
        out["gpu_time"] = "The trace has no GPU kernels inside its steps."
    if kind == "ddp" and "comms" not in has:
        out["comms"] = "No gradient all-reduce was recorded (one rank, or no backward yet)."
    if kind == "fsdp" and "comms" not in has:
        out["comms"] = "No all-gather or reduce-scatter was recorded (one rank: FSDP shards nothing)."
    if "work" not in has and kind != "empty" and trace and work is DATAPARALLEL_WORK:
        out["work"] = ("The trace has no dpprof.apply ranges: torch.profiler did not profile the threads that run "
                       f"the replicas (it is thread-local; profile with {PROFILE_ALL_THREADS}), so there is no apply "
                       "per device.")
    elif "work" not in has and kind != "empty":
        out["work"] = (f"The trace's steps have no {work.label}: no forward range (DataParallel.forward, "
                       "DistributedDataParallel.forward) and no backward op in them, so there is no compute per "
                       f"{'rank' if kind == 'ddp' or run.ranks > 1 or run.meta.get('rank') is not None else 'device'}."
                       if trace else f"No {work.label} phases recorded yet: no forward call has finished.")
    return out


def describe(run: StoredRun) -> RunModel:
    """Read what a run is and holds (StoredRun.model calls this once per opened run)."""
    # steps are never deleted, so the last rowid is the count: one lookup where COUNT(*) reads the table
    counts = run.query("SELECT COALESCE(MAX(rowid), 0) AS n FROM steps")["n"]
    steps = int(counts.max()) if len(counts) else 0  # ranks step together: each rank's file has every step
    # never past the last step: the sample of a thinned run's steps (sampled_steps_sql) counts up to it
    detail_from = min(int(run.meta.get("detail_from") or 0), steps)
    retention = stored_retention(run.meta.get("detail"))
    phases = present_phases(run, aggregates=retention is not None)
    kind = _kind(run, steps, phases)
    tables = _nonempty_tables(run)
    work = _work(phases, kind)
    has = (tables - {"steps", "devices", "notes", "findings"}) | ({"work"} if set(work.phases) & set(phases) else set())
    if retention is not None:  # the aggregates name every device, whose rows may have been thinned away
        seen = [str(d) for d in (distinct(run, "memory_blocks", "device") or
                                 run.query("SELECT DISTINCT device FROM phase_blocks")["device"].tolist())]
    else:
        seen = [str(d) for d in (distinct(run, "memory", "device") or distinct(run, "phases", "device"))]
    seen += [str(d) for d in distinct(run, "allocator", "device") if d not in seen]
    listed = [str(d) for d in run.meta.get("devices") or []]
    if run.ranks > 1 or kind in ("ddp", "fsdp") or any(d.startswith("rank:") for d in listed):
        listed = sorted(listed, key=device_key)  # a rank's files list its own devices: order them by rank
    devices = listed + sorted((d for d in seen if d not in listed), key=device_key)
    worked = set(seen)
    idle = (tuple(d for d in listed if d not in worked)
            if kind in ("dataparallel", "balanced") and worked and run.ranks == 1 else ())
    backend = run.meta.get("backend")
    return RunModel(kind=kind, imported=run.meta.get("source") == TRACE_SOURCE, backend=backend, steps=steps,
                    phases=tuple(phases), work=work, devices=tuple(devices), idle=idle, has=frozenset(has),
                    missing=_missing(run, kind, has, backend, work) if steps else {},
                    empty_reason=_empty_reason(run) if kind == "empty" else None, retention=retention,
                    detail_from=detail_from, aggregated=retention is not None and run.read != "rows" and (
                        run.read == "aggregates" or (retention.bounded and detail_from > 0) or steps > ROWS_READ_STEPS),
                    world_size=int(run.meta["world_size"]) if run.meta.get("world_size") else None,
                    ranks=tuple(sorted(int(r) for r in run.meta.get("ranks") or [] if r is not None)),
                    dist_backend=distributed_backend(run.meta),
                    sharded=bool((run.meta.get("workload_args") or {}).get("fsdp")),
                    ddp_buckets=bool((run.meta.get("workload_args") or {}).get("ddp_buckets")),
                    comm_hook=(run.meta.get("workload_args") or {}).get("comm_hook"))
