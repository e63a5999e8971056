"""A dpprof run as a Chrome Trace Event file, in the form torch.profiler (Kineto) writes: for Perfetto,
chrome://tracing and Holistic Trace Analysis (``dpprof export RUN --trace FILE.json[.gz]``).

What the file holds:

- Kineto's top-level fields: ``schemaVersion``, ``deviceProperties`` (the run's GPUs), ``distributedInfo`` (a
  rank's file), ``host_name`` (where every rank in the file ran on one host), ``traceEvents``, ``traceName``,
  ``displayTimeUnit``, ``baseTimeNanoseconds`` (when the run
  started: ``ts`` and ``dur`` are microseconds since then); and dpprof's: ``dpprofExport`` (the run, its name,
  workload, kind and devices, the CUDA index of each GPU among them, which steps the file holds and why) and, after
  the events, ``dpprofThreads`` (the device of each thread id, so that ``dpprof import`` reads the file back
  exactly: dpprof.trace.readback).
- A process per device (or rank), named by ``process_name`` metadata and ordered by ``process_sort_index`` in
  the run's device order. Its threads are lanes: ``steps`` (``ProfilerStep#N``, on the device that drives the
  steps), ``host`` (the phases the calling thread runs: scatter, replicate, parallel_apply, gather, loss, reduce,
  backward; a rank's data, forward, backward and its parts, optimizer), ``replica`` (the replica's apply),
  ``collectives`` (DDP's bucket all-reduces and FSDP's all-gathers and reduce-scatters from launch to completion;
  an imported trace's collectives) and ``allocator`` (the CUDA allocator's readings as Kineto's ``[memory]``
  events). Slices of one lane either nest or are disjoint: one that would cross another goes to a lane of its own
  (``host #2``), since Perfetto drops slices that cross.
- Every phase as a complete event (``"ph": "X"``) named as its profiler range (``dpprof.scatter``,
  ``dpprof.apply``, ...), with ``step`` and ``call`` in ``args``; its host time is the slice, its CUDA event time
  ``args.device_duration_ms`` (CUDA runs).
- Counters (``"ph": "C"``): dpprof's memory accounting per device and step (``dpprof memory (bytes)``, what it
  held by kind, forward calls summed, at the step's start), the CUDA allocator's allocated, reserved and peak
  bytes (at the end of the phase they were read after), and NVML's samples, a counter per metric.

Which steps: every step the run holds in full (a thinned run's, dpprof.store.retention: its first steps, one in
``every``, outliers, peaks and its newest), or those of ``--steps A:B``. A viewer has limits (chrome://tracing
struggles above ~1M events and ~256 MiB of JSON; the Perfetto UI above ~2 GB of browser memory): without
``--steps``, a run whose steps would make more exports its newest steps that fit, and says so in one line.

Events are written as they are made, a chunk of steps at a time, one JSON object per line (gzip when the name
ends in ``.gz``): memory stays that of a chunk however long the run.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from dpprof.outputs import Outputs
from dpprof.records import MEMORY_BYTES, DeviceRecord, device_key
from dpprof.store import trace_rows
from dpprof.store.reader import StoredRun
from dpprof.trace.decode import is_gzip_name, trace_suffix
from dpprof.trace.readback import EXPORT_KEY, EXPORT_VERSION, THREADS_KEY
from dpprof.units import plural

__all__ = ["MAX_EVENTS", "MAX_BYTES", "TracePlan", "TraceWritten", "parse_steps", "plan_trace", "write_trace",
           "export_trace", "rank_path", "trace_bytes"]

# What a trace viewer opens: chrome://tracing slows to a crawl above about a million events and fails on JSON
# above about 256 MiB; the Perfetto UI holds about 2 GB of browser memory (some 10x a file's JSON). The lower wins.
MAX_EVENTS = 1_000_000
MAX_BYTES = 256 * 2**20
CHUNK_STEPS = 1_000  # steps read from the run file at a time: what the writer holds in memory
PROBE_STEPS = 200  # steps counted at each end of the selection to estimate the events a step makes
METADATA_EVENTS = 12  # per device: its process's name and order, and its lanes' (with a spare)
EVENT_BYTES = 190  # mean JSON bytes of one event as written (measured on recorded runs: 150-210)
SAMPLE_ROWS_PER_QUERY = 50_000  # NVML samples read at a time
# Lanes of a device's process, in the order they are listed; a phase runs on the host lane but for apply.
LANES = ("steps", "host", "replica", "collectives", "allocator")
TID_STRIDE = 1_000  # thread ids are pid * TID_STRIDE + lane: unique in the file (dpprofThreads maps them)
# NVML's metrics as counters: the counter's name (its unit in it) -> the gpu_samples columns it shows.
SAMPLE_COUNTERS = {
    "GPU utilization (%)": ("gpu_util_pct",),
    "GPU memory utilization (%)": ("memory_util_pct",),
    "GPU memory used (bytes)": ("memory_used_bytes",),
    "GPU memory of other processes (bytes)": ("other_process_memory_bytes",),
    "power (W)": ("power_w",),
    "temperature (C)": ("temperature_c",),
    "SM clock (MHz)": ("sm_clock_mhz",),
    "PCIe (bytes/s)": ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"),
}
ALLOCATOR_COUNTERS = {"CUDA allocated (bytes)": "allocated_bytes", "CUDA reserved (bytes)": "reserved_bytes",
                      "CUDA peak allocated in step (bytes)": "peak_allocated_bytes"}
MEMORY_COUNTER = "dpprof memory (bytes)"
KINETO_BACKENDS = ("gloo", "nccl", "mpi", "ucc")  # the backends whose collective ops Kineto names <backend>:<op>
_DENSE = (",", ":")
TRACE_TABLES = ("steps", "phases", "memory", "allocator", "comms", "gpu_samples")  # the run's tables a trace shows


def parse_steps(text: str | None) -> tuple[int | None, int | None] | None:
    """``--steps A:B``: steps A to B-1 (Python's slice; ``A:`` or ``:B`` open at one end), or ``N``: step N alone.

    Raises:
        ValueError: not of that form, A or B negative, or B not after A.
    """
    if text is None:
        return None
    # plain ASCII digits: int() would also take 2_0 as 20, +3 and other scripts' digits; a sign is said below
    form = re.fullmatch(r"\s*(-?[0-9]*)\s*(:)?\s*(-?[0-9]*)\s*", text)
    if form is None or (form[2] is None and form[3]):
        raise ValueError(f"--steps {text!r}: expected A:B (steps A to B-1), A:, :B or N")
    head, colon, tail = form.groups()
    lo = int(head) if head.strip("-") else None
    hi = int(tail) if tail.strip("-") else None
    if head == "-" or tail == "-":
        raise ValueError(f"--steps {text!r}: expected A:B (steps A to B-1), A:, :B or N")
    if not colon:
        if lo is None:
            raise ValueError(f"--steps {text!r}: expected A:B (steps A to B-1), A:, :B or N")
        hi = lo + 1
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):  # not Python's from-the-end: said, not clipped
        raise ValueError(f"--steps {text!r}: steps count from 0, so A and B cannot be negative (A:B is steps A to B-1)")
    if lo is not None and hi is not None and hi <= lo:
        raise ValueError(f"--steps {text!r}: B must be after A (A:B is steps A to B-1)")
    return lo, hi


def _ranges(steps: np.ndarray) -> list[list[int]]:
    """Sorted step numbers as half-open [start, stop) ranges of consecutive steps."""
    if not len(steps):
        return []
    breaks = np.flatnonzero(np.diff(steps) != 1)
    starts = np.concatenate([[0], breaks + 1])
    stops = np.concatenate([breaks, [len(steps) - 1]])
    return [[int(steps[a]), int(steps[b]) + 1] for a, b in zip(starts, stops)]


def _ranges_text(ranges: list[list[int]], most: int = 4) -> str:
    said = [f"{a}:{b}" if b - a > 1 else str(a) for a, b in ranges[:most]]
    return ", ".join(said) + (f" and {len(ranges) - most:,} more ranges" if len(ranges) > most else "")


@dataclass
class TracePlan:
    """Which steps a trace of the run holds, and what they will make (events and bytes, estimated)."""

    run_steps: int  # the steps the run recorded (those whose rows are damaged among them)
    held: int  # of them, those held in full (every step of a run whose detail was not thinned)
    steps: np.ndarray  # the steps to write, sorted
    asked: tuple[int | None, int | None] | None  # --steps A:B
    events: int  # estimated events
    bytes: int  # estimated JSON bytes, uncompressed
    cut: bool = False  # over the viewers' limit without --steps: the newest steps that fit
    over: bool = False  # what --steps asked for is over the limit (written all the same)
    thinned: bool = False
    damaged_steps: int = 0  # of the steps recorded, those whose row the store left out as damaged (the most of a file)
    damaged_rows: int = 0  # rows of the trace's tables the store left out as damaged (dpprof.store.validation)
    held_ranges: str = ""  # the steps held in full, as ranges: what --steps can pick from

    _run: StoredRun | None = field(default=None, repr=False)
    _step_rows: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def step_rows(self) -> pd.DataFrame:
        """The written steps' rows of the steps table (every rank's), with "rank": read when a trace is written,
        never to plan one (a 300,000-step run's rows take a second to read)."""
        if self._step_rows is None:
            assert self._run is not None, "a plan made without its run"
            rows = trace_rows.step_rows(self._run)
            self._step_rows = rows[rows["step"].isin(self.steps)].reset_index(drop=True)
        return self._step_rows

    @property
    def ranges(self) -> list[list[int]]:
        """The steps written, as half-open ranges [start, stop)."""
        return _ranges(self.steps)

    def why(self) -> str:
        """Which steps the file holds and why, in one sentence (the file's metadata says it too)."""
        n = len(self.steps)
        which = _ranges_text(self.ranges)
        if self.cut:
            return (f"the newest {n:,} of the {self.held:,} steps held in full (steps {which}): all of them would "
                    f"make about {self._full_events:,} events, over what a trace viewer opens "
                    f"({self._limits[0]:,} events or {self._limits[1] / 2**20:g} MiB); --steps A:B picks others")
        asked = f" of --steps {_asked_text(self.asked)}" if self.asked else ""
        said = f"{n:,} step{'s' if n != 1 else ''}{asked}: {which}" if n else f"no step{asked}"
        if self.thinned:
            said += (f" (the run holds {self.held:,} of its {self.run_steps:,} steps in full: its detail was thinned, "
                     "the others keep only their step time and the aggregates)")
        if self.damaged_steps:
            said += (f" ({self.damaged_steps:,} of the run's {self.run_steps:,} steps left out: their rows in the run "
                     "file are damaged)")
        return said

    def left_out_text(self, unwritable: int = 0) -> str:
        """What the file leaves out, in one sentence ("" for nothing): the run file's damaged rows (the store left
        them out as it read them), and rows whose time the file cannot hold (``unwritable``)."""
        said = []
        if self.damaged_rows:
            said.append(f"{plural(self.damaged_rows, 'damaged row')} of the run file "
                        "(dpprof show lists them)")
        if unwritable:
            said.append(f"{plural(unwritable, 'row')} with a time that is not a number, "
                        "infinite or negative")
        verb = "were" if self.damaged_rows + unwritable != 1 else "was"
        return f"{' and '.join(said)} {verb} left out" if said else ""

    _full_events: int = field(default=0, repr=False)  # what every step asked for would have made
    _limits: tuple[int, int] = field(default=(MAX_EVENTS, MAX_BYTES), repr=False)  # (events, bytes) a file may hold


def _asked_text(asked: tuple[int | None, int | None] | None) -> str:
    if not asked:
        return ""
    lo, hi = asked
    return f"{'' if lo is None else lo}:{'' if hi is None else hi}"


def _events_per_step(run: StoredRun, steps: np.ndarray, cuda: bool) -> float:
    """Events a step makes, counted on up to PROBE_STEPS steps at each end of ``steps`` (every rank's)."""
    blocks = [steps[:PROBE_STEPS], steps[-PROBE_STEPS:]] if len(steps) > 2 * PROBE_STEPS else [steps]
    events = counted = 0
    for block in blocks:
        if not len(block):
            continue
        lo, hi = int(block[0]), int(block[-1])
        n = trace_rows.event_counts(run, lo, hi).sum()
        ranks = run.ranks
        events += (int(n["phases"]) + int(n["memory"]) + (4 if cuda else 3) * int(n["allocator"]) + int(n["comms"])
                   + len(block) * ranks)
        counted += len(block)
    return events / counted if counted else 0.0


def plan_trace(run: StoredRun, steps: tuple[int | None, int | None] | None = None, max_events: int | None = None,
               max_bytes: int | None = None) -> TracePlan:
    """Which steps a trace of ``run`` holds: those held in full (of ``steps``, ``--steps A:B``), the newest that
    fit in ``max_events`` and ``max_bytes`` (MAX_EVENTS, MAX_BYTES) when ``steps`` is None and they would not.

    Returns:
        the plan: steps, their rows, estimated events and bytes, and ``why()`` in words.
    """
    durations = trace_rows.held_step_spans(run).groupby("step")["longest_ms"].max()  # by step, sorted
    held = durations.index.to_numpy(dtype=np.int64)
    chosen = held
    if steps is not None:
        lo, hi = steps
        if lo is not None:
            chosen = chosen[chosen >= lo]
        if hi is not None:
            chosen = chosen[chosen < hi]
    cuda = any(str(d).startswith("cuda:") for d in run.model.devices)
    per_step = _events_per_step(run, chosen, cuda)
    samples = int(trace_rows.gpu_sample_rows(run).sum())  # never deleted: the count
    total_ms = (trace_rows.steps_total_ms(run) or 1.0) if samples else 1.0  # read only where it weighs samples

    named = METADATA_EVENTS * (len(run.model.devices) + 1)  # processes and lanes named, a GPU or two sampled

    def estimate(chosen_steps: np.ndarray) -> int:
        """Events of the steps' rows, and the counter events NVML's samples make over their share of the run's
        time (every metric of every sample)."""
        share = float(durations.reindex(chosen_steps).sum()) * run.ranks / total_ms if samples else 0.0
        return int(per_step * len(chosen_steps)) + int(samples * len(SAMPLE_COUNTERS) * min(1.0, share)) + named

    events = estimate(chosen)
    damaged = run.damaged_rows  # what dpprof show says of the run file, as counts
    damaged_steps = max((tables.get("steps", 0) for tables in damaged.values()), default=0)
    plan = TracePlan(run_steps=run.model.steps + damaged_steps, held=len(held), steps=chosen, asked=steps,
                     events=events, bytes=events * EVENT_BYTES, thinned=run.model.thinned,
                     damaged_steps=damaged_steps,
                     damaged_rows=sum(n for tables in damaged.values() for t, n in tables.items() if t in TRACE_TABLES),
                     held_ranges=_ranges_text(_ranges(held)), _run=run)
    max_events = MAX_EVENTS if max_events is None else max_events
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    limit = min(max_events, max_bytes // EVENT_BYTES)
    plan._limits = (max_events, max_bytes)
    if events > limit:
        if steps is None:
            fit = max(1, int(len(chosen) * limit / events * 0.95))  # a margin for the estimate's error
            plan._full_events = events
            plan.steps = chosen[-fit:]
            plan.events = estimate(plan.steps)
            plan.bytes = plan.events * EVENT_BYTES
            plan.cut = True
        else:
            plan.over = True
    return plan


@dataclass
class TraceWritten:
    """One trace file written: where, how many events and bytes (uncompressed JSON and on disk), how long."""

    path: Path | None
    events: int
    json_bytes: int
    file_bytes: int
    seconds: float
    ranks: list[int]
    left_out: str = ""  # what the file leaves out, in one sentence (its dpprofLeftOut); "" for nothing


class _Out:
    """The file being written: JSON text in UTF-8, gzip'd when asked; counts what it writes."""

    def __init__(self, stream: IO[bytes], gz: bool) -> None:
        self._raw = stream
        # mtime 0: the same run gives the same bytes; level 6: most of 9's size at a third of its time
        self._gz = gzip.GzipFile(fileobj=stream, mode="wb", compresslevel=6, mtime=0) if gz else None
        self._out = self._gz if self._gz is not None else stream
        self._buf: list[str] = []
        self._pending = 0
        self.events = 0
        self.bytes = 0
        self._first = True

    def text(self, s: str) -> None:
        self._buf.append(s)
        self._pending += len(s)
        if self._pending > 1 << 20:
            self.flush()

    def event(self, s: str) -> None:
        self.text(s if self._first else ",\n" + s)
        self._first = False
        self.events += 1

    def flush(self) -> None:
        data = "".join(self._buf).encode()
        self._buf.clear()
        self._pending = 0
        self.bytes += len(data)
        self._out.write(data)

    def close(self) -> None:
        self.flush()
        if self._gz is not None:
            self._gz.close()


def _us(ns: int) -> str:
    """Integer nanoseconds as microseconds with three decimals, as Kineto writes ts and dur."""
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    return f"{sign}{ns // 1000}.{ns % 1000:03d}"


# A time the store should not hold (NaN, infinite, or past what an import accepts: dpprof.trace.numbers) leaves its
# row out of the trace rather than end the export; a time in ms at most this is written.
MAX_EXPORT_MS = 2 ** 52 / 1e3


def _ns(ms: Any) -> int | None:
    """Milliseconds as integer nanoseconds; None for a time that cannot be written (NaN, infinite, absurd, NULL)."""
    if ms is None or not isinstance(ms, (int, float)) or not -MAX_EXPORT_MS <= ms <= MAX_EXPORT_MS:
        return None
    return int(round(ms * 1e6))


def _span_ns(start_ms: Any, ms: Any, offset: int) -> tuple[int, int] | None:
    """(start, end) in ns on the file's clock, or None where either time cannot be written or the end is before
    the start (the row is left out)."""
    start, length = _ns(start_ms), _ns(ms)
    if start is None or length is None or length < 0:
        return None
    return start + offset, round((start_ms + ms) * 1e6) + offset


def _epoch_ns(iso: str) -> int:
    t = datetime.fromisoformat(iso)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return (t - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1) * 1000


def _columns(df: pd.DataFrame, *names: str) -> list[list[Any]]:
    """Columns as Python lists (ints, floats, str, None): what a loop over rows reads fastest."""
    return [df[n].tolist() for n in names]


def _int(v: Any) -> int | None:
    """A whole number for the file; None for a missing value, NaN, an infinity or one past int64."""
    if v is None or v != v or not isinstance(v, (int, float, np.number)) or not -2 ** 63 < v < 2 ** 63:
        return None
    return int(v)


def _json(args: dict[str, Any]) -> str:
    """Args as dense JSON, without missing values."""
    return json.dumps(_clean(args), separators=_DENSE)


def _clean(args: dict[str, Any]) -> dict[str, Any]:
    """Args without missing values, numpy scalars as Python numbers (json writes them)."""
    out = {}
    for k, v in args.items():
        if v is None or (isinstance(v, (float, np.floating)) and not math.isfinite(v)):  # JSON has no NaN or inf
            continue
        out[k] = v.item() if isinstance(v, np.generic) else v
    return out


class _Lanes:
    """Each device's lanes (threads), made as slices need them so that no two slices of one lane cross."""

    def __init__(self, out: _Out) -> None:
        self._out = out
        self._lanes: dict[tuple[int, str], list[list[Any]]] = {}  # (pid, kind) -> [tid, last start, open stack]
        self.device_of: dict[str, str] = {}  # tid -> device
        self._count: dict[int, int] = {}

    def place(self, pid: int, device: str, kind: str, start: int, end: int) -> int:
        """The thread id of a lane of ``kind`` where [start, end] nests in or follows what it holds (slices come
        in order of start, longer first: then a lane's open slices are a chain, each inside the one before)."""
        lanes = self._lanes.setdefault((pid, kind), [])
        for lane in lanes:
            tid, last, stack = lane
            if start < last:  # out of order for this lane: it could cross a slice closed already
                continue
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                lane[1] = start
                return tid
        n = self._count.get(pid, 0)
        self._count[pid] = n + 1
        tid = pid * TID_STRIDE + n
        lanes.append([tid, start, [end]])
        name = kind if len(lanes) == 1 else f"{kind} #{len(lanes)}"
        self.device_of[str(tid)] = device
        self._out.event(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":"{name}"}}}}')
        self._out.event(f'{{"ph":"M","name":"thread_sort_index","pid":{pid},"tid":{tid},'
                        f'"args":{{"sort_index":{LANES.index(kind) * 100 + len(lanes)}}}}}')
        return tid

    def instant_lane(self, pid: int, device: str, kind: str) -> int:
        """The lane of instant events of ``kind`` (they take no time: one lane holds them all)."""
        lanes = self._lanes.get((pid, kind))
        if lanes:
            return lanes[0][0]
        return self.place(pid, device, kind, 0, 0)


def _kineto_backend(backend: Any, gpu: bool) -> str | None:
    """The backend that names a run's collectives as Kineto names them (``gloo:all_reduce``, what ``dpprof import``
    reads as a collective): the run's, where it is one of KINETO_BACKENDS; of one per device type
    ("cpu:gloo,cuda:nccl"), the ranks' device's; for a process group made without naming one (torch's get_backend()
    says "undefined"), the one torch uses on the ranks' device (nccl on a GPU, gloo on a CPU); else None.

    Example:
        >>> _kineto_backend("undefined", gpu=False), _kineto_backend("cpu:gloo,cuda:nccl", gpu=True)
        ('gloo', 'nccl')
    """
    if backend in KINETO_BACKENDS or not isinstance(backend, str):
        return backend if backend in KINETO_BACKENDS else None
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    named = per_device.get("cuda" if gpu else "cpu") if per_device else \
        ("nccl" if gpu else "gloo") if backend == "undefined" else None
    return named if named in KINETO_BACKENDS else None


def _device_names(run: StoredRun) -> dict[str, str]:
    """What each device is, from the run's inventory: "NVIDIA A100", "CPU worker thread", "on host-3"."""
    names = {}
    for row in run.devices.itertuples():
        name = getattr(row, "name", None)
        if isinstance(name, str) and name:
            names[str(row.device)] = name[len("rank "):] if name.startswith("rank on ") else name
    return names


def _device_properties(run: StoredRun, gpus: dict[str, int]) -> list[dict[str, Any]]:
    """Kineto's deviceProperties for the file's CUDA devices (``gpus``: device -> its CUDA index, a rank's GPU
    among them), from the run's device inventory."""
    out = []
    for row in run.devices.drop_duplicates("device").itertuples():
        gpu = gpus.get(str(row.device))
        if gpu is None or any(p["id"] == gpu for p in out):
            continue
        props: dict[str, Any] = {"id": gpu, "name": row.name}
        if pd.notna(row.total_memory_bytes):
            props["totalGlobalMem"] = int(row.total_memory_bytes)
        if isinstance(row.capability, str) and "." in row.capability:
            major, minor = row.capability.split(".", 1)
            if major.isdigit() and minor.isdigit():
                props["computeMajor"], props["computeMinor"] = int(major), int(minor)
        if pd.notna(row.multiprocessor_count):
            props["numSms"] = int(row.multiprocessor_count)
        out.append(_clean(props))
    return sorted(out, key=lambda p: p["id"])


def _inventory(view: StoredRun, devices: list[str]) -> list[dict[str, Any]]:
    """The file's devices' inventory rows (DeviceRecord's fields, each known one), for dpprof import to read back
    whole (dpprof.trace.readback.exported_inventory): Kineto's deviceProperties hold a GPU's name, memory, SMs and
    capability only, and nothing of a CPU worker's."""
    table = view.devices
    if table.empty:
        return []
    names = [f.name for f in dataclass_fields(DeviceRecord)]
    rows = table[table["device"].isin(devices)].drop_duplicates("device")
    return [_clean({f: None if pd.isna(row.get(f)) else row.get(f) for f in names}) for row in rows.to_dict("records")]


def _file_meta(view: StoredRun) -> pd.DataFrame:
    """Each file's own run row: rank, created_at (None where it was no date), devices (a list), host."""
    return view.file_meta()


def _chunks(steps: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for i in range(0, len(steps), size):
        yield steps[i:i + size]


class _TraceWriter:
    """Writes the events of one file: the given files (ranks) of the run, the plan's steps."""

    def __init__(self, run: StoredRun, view: StoredRun, plan: TracePlan, out: _Out) -> None:
        self.run, self.view, self.plan, self.out = run, view, plan, out
        self.model = run.model
        metas = _file_meta(view)
        self.ranks = sorted(int(r) for r in metas["rank"])
        hosts = set(metas["host"].dropna())
        self.host = hosts.pop() if len(hosts) == 1 and metas["host"].notna().all() else None  # the files' one host
        dated = {int(r): _epoch_ns(c) for r, c in zip(metas["rank"], metas["created_at"]) if c}
        # a file whose start was no date (dpprof.store.validation) is taken to start with the others
        created = {int(r): dated.get(int(r), min(dated.values(), default=0)) for r in metas["rank"]}
        self.base_ns = min(created.values())
        self.offset_ns = {r: created[r] - self.base_ns for r in created}  # each rank's clock on the file's
        listed: dict[str, int] = {}
        for rank, devices in zip(metas["rank"], metas["devices"]):
            for d in devices or []:
                listed.setdefault(str(d), int(rank))
        if run.ranks == 1:  # one file: every device of the run's axis, those that recorded before the run row said
            for d in self.model.devices:
                listed.setdefault(str(d), self.ranks[0])
        order = list(self.model.devices)
        self.devices = sorted(listed, key=lambda d: (order.index(d) if d in order else len(order), device_key(d)))
        self.rank_of = listed
        self.pid_of: dict[str, int] = {d: (order.index(d) if d in order else len(order) + i) + 1
                                       for i, d in enumerate(self.devices)}
        # the device each rank's steps go on: the first of its devices (DataParallel's device_ids[0])
        self.step_device = {}
        for d in self.devices:
            self.step_device.setdefault(self.rank_of[d], d)
        self.lanes = _Lanes(out)
        self.names = _device_names(run)
        args = run.meta.get("workload_args") or {}
        info = args.get("distributedInfo") if isinstance(args.get("distributedInfo"), dict) else {}
        backend = args.get("backend") or info.get("backend")  # a recorded DDP run's, else an imported trace's
        self.cuda = {str(d) for d, k in zip(run.devices["device"], run.devices["kind"]) if k == "cuda"} \
            if len(run.devices) else set()  # the devices the run's inventory says are GPUs
        self.allocated: dict[str, int] = {}  # device -> the Total Allocated of its last [memory] event written
        self.left_out = 0  # rows whose time cannot be written (NaN, infinite: the store should not hold them)
        self.backend = _kineto_backend(backend, gpu=bool(self.cuda))

    def process(self, device: str) -> int:
        """The pid of a device, naming its process the first time."""
        pid = self.pid_of.get(device)
        if pid is None:  # a GPU NVML sampled that is not on the device axis (a rank's "cuda:N")
            pid = self.pid_of[device] = max(self.pid_of.values(), default=0) + 1
            self.devices.append(device)
            self._name(device, pid)
        return pid

    def _name(self, device: str, pid: int) -> None:
        label = device.replace("rank:", "rank ") if device.startswith("rank:") else device
        name = f"{label} ({self.names[device]})" if self.names.get(device) else label
        self.out.event(f'{{"ph":"M","name":"process_name","pid":{pid},"tid":0,"args":{{"name":{json.dumps(name)}}}}}')
        self.out.event(f'{{"ph":"M","name":"process_sort_index","pid":{pid},"tid":0,"args":{{"sort_index":{pid}}}}}')

    def write(self) -> None:
        for device in list(self.devices):
            self._name(device, self.pid_of[device])
        rows = self.plan.step_rows
        rows = rows[rows["rank"].isin(self.ranks)]
        for chunk in _chunks(self.plan.steps, CHUNK_STEPS):
            self._chunk(chunk, rows[rows["step"].isin(chunk)])
        self._samples()

    def _chunk(self, chunk: np.ndarray, steps: pd.DataFrame) -> None:
        lo, hi = int(chunk[0]), int(chunk[-1])
        rows = trace_rows.chunk_rows(self.view, lo, hi)
        phases = rows.phases[rows.phases["step"].isin(chunk)]
        memory = rows.memory[rows.memory["step"].isin(chunk)]
        allocator = rows.allocator[rows.allocator["step"].isin(chunk)]
        comms = rows.comms[rows.comms["step"].isin(chunk)]
        # slices: (start_ns, -end_ns, pid, device, lane, end_ns, name as JSON, args as JSON)
        slices: list[tuple[int, int, int, str, str, int, str, str]] = []
        step_start: dict[tuple[int, int], int] = {}
        step_end: dict[tuple[int, int], int] = {}
        offset = self.offset_ns
        for rank, step, start_ms, ms, batch, calls, used in zip(*_columns(
                steps, "rank", "step", "start_ms", "duration_ms", "batch_size", "forward_calls", "devices_used")):
            span = _span_ns(start_ms, ms, offset[rank])
            if span is None:
                self.left_out += 1
                continue
            start, end = span
            step_start[(rank, step)] = start
            step_end[(rank, step)] = end
            device = self.step_device.get(rank)
            if device is None:
                continue
            args = _json({"step": step, "batch_size": _int(batch), "forward_calls": _int(calls), "devices_used": _int(used)})
            slices.append((start, -end, self.pid_of[device], device, "steps", end, f'"ProfilerStep#{step}"', args))
        ends: dict[tuple[int, int, int, str, str], int] = {}
        for rank, step, call, phase, device, start_ms, ms, cuda_ms in zip(*_columns(
                phases, "rank", "step", "call", "phase", "device", "start_ms", "duration_ms", "device_duration_ms")):
            span = _span_ns(start_ms, ms, offset[rank])
            if span is None:
                self.left_out += 1
                continue
            start, end = span
            ends[(rank, step, call, phase, device)] = end
            args = (f'{{"step":{step},"call":{call},"device_duration_ms":{cuda_ms!r}}}' if _ns(cuda_ms) is not None
                    else f'{{"step":{step},"call":{call}}}')
            slices.append((start, -end, self.process(device), device, "replica" if phase == "apply" else "host", end,
                           f'"dpprof.{phase}"', args))
        for rank, step, device, bucket, nbytes, launch_ms, ms, collective in zip(*_columns(
                comms, "rank", "step", "device", "bucket", "bucket_bytes", "launch_ms", "duration_ms", "collective")):
            span = _span_ns(launch_ms, ms, offset[rank])
            if span is None:
                self.left_out += 1
                continue
            start, end = span
            name = str(collective)  # every row's is named (dpprof.store.reader.named_collectives)
            if ":" not in name and self.backend is not None:  # DDP's all-reduce, FSDP's all-gather: gloo:all_gather
                name = f"{self.backend}:{name.replace('-', '_').replace('/', '_')}"
            args = {"step": step, "bucket": _int(bucket), "bucket_bytes": _int(nbytes)}
            if ":" in name and args["bucket_bytes"] is not None:  # Kineto's collective args: bytes as Byte elements
                args.update({"In msg nelems": args["bucket_bytes"], "dtype": "Byte"})
            slices.append((start, -end, self.process(device), device, "collectives", end, json.dumps(name), _json(args)))
        slices.sort(key=lambda x: (x[0], x[1]))
        event, place = self.out.event, self.lanes.place
        for start, _, pid, device, lane, end, name, args in slices:
            tid = place(pid, device, lane, start, end)
            event(f'{{"ph":"X","cat":"user_annotation","name":{name},"pid":{pid},"tid":{tid},"ts":{_us(start)},'
                  f'"dur":{_us(end - start)},"args":{args}}}')
        columns = _columns(memory, "rank", "step", "device", *MEMORY_BYTES)
        for rank, step, device, *held in zip(*columns):
            ts = step_start.get((rank, step))
            if ts is None:
                continue
            args = ",".join(f'"{c}":{_int(v)}' for c, v in zip(MEMORY_BYTES, held) if _int(v) is not None)
            event(f'{{"ph":"C","name":"{MEMORY_COUNTER}","pid":{self.process(device)},"ts":{_us(ts)},"args":{{{args}}}}}')
        for rank, step, call, phase, device, allocated, peak, reserved in zip(*_columns(
                allocator, "rank", "step", "call", "phase", "device", "allocated_bytes", "peak_allocated_bytes",
                "reserved_bytes")):
            ts = ends.get((rank, step, call, phase, device), step_end.get((rank, step)))
            if ts is None:
                continue
            pid = self.process(device)
            values = {"allocated_bytes": allocated, "reserved_bytes": reserved, "peak_allocated_bytes": peak}
            for counter, column in ALLOCATOR_COUNTERS.items():
                value = _int(values[column])
                if value is not None:
                    event(f'{{"ph":"C","name":"{counter}","pid":{pid},"ts":{_us(ts)},"args":{{"{column}":{value}}}}}')
            gpu = self._gpu_index(device)
            if gpu is not None:  # Kineto's form, for torch's tools and the importer
                self._memory_events(pid, device, gpu, step_start.get((rank, step), ts), ts, allocated, peak, reserved)

    def gpus(self) -> dict[str, int]:
        """The file's CUDA devices and the index each has in deviceProperties and the ``[memory]`` events."""
        return {d: gpu for d in self.devices if (gpu := self._gpu_index(d)) is not None}

    def _gpu_index(self, device: str) -> int | None:
        """The CUDA index of a device ("cuda:1"; an imported trace's "rank:3" names its rank's GPU, its only one)."""
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
        return 0 if device.startswith("rank:") and device in self.cuda else None

    def _memory_events(self, pid: int, device: str, gpu: int, start: int, end: int, allocated: Any, peak: Any,
                       reserved: Any) -> None:
        """One allocator reading as Kineto's ``[memory]`` events: the peak inside the span (halfway through it),
        then what stayed allocated at its end, each with its Total Allocated, Total Reserved and Bytes (the change
        from the device's previous event), so that the importer reads back the peak, the end and the reserved."""
        tid = self.lanes.instant_lane(pid, device, "allocator")
        at_end = _int(allocated)
        readings = [((start + end) // 2, _int(peak)), (end, at_end)] if _int(peak) is not None else [(end, at_end)]
        for ts, total in readings:
            if total is None:
                continue
            args = _json({"Device Type": 1, "Device Id": gpu, "Bytes": total - self.allocated.get(device, total),
                          "Total Allocated": total, "Total Reserved": _int(reserved)})
            self.allocated[device] = total
            self.out.event(f'{{"ph":"i","s":"t","cat":"cpu_instant_event","name":"[memory]","pid":{pid},"tid":{tid},'
                           f'"ts":{_us(ts)},"args":{args}}}')

    def _segments(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per rank: the time spans (ms) of the runs of consecutive steps written, where samples are written."""
        rows = self.plan.step_rows
        out = {}
        for rank, df in rows[rows["rank"].isin(self.ranks)].groupby("rank"):
            df = df.sort_values("step")
            steps = df["step"].to_numpy(dtype=np.int64)
            new = np.concatenate([[True], np.diff(steps) != 1])
            group = np.cumsum(new)
            starts = df.groupby(group)["start_ms"].min().to_numpy()
            ends = (df["start_ms"] + df["duration_ms"]).groupby(group).max().to_numpy()
            out[int(rank)] = (starts, ends)
        return out

    def _samples(self) -> None:
        """NVML's samples inside the steps written, a counter per metric (one pass over the table)."""
        if not trace_rows.gpu_sample_rows(self.view).max():
            return
        segments = self._segments()
        columns = sorted({c for cols in SAMPLE_COUNTERS.values() for c in cols})
        for df in trace_rows.gpu_sample_batches(self.view, columns, SAMPLE_ROWS_PER_QUERY):
            for rank, part in df.groupby("rank"):
                if int(rank) not in segments:
                    continue
                starts, ends = segments[int(rank)]
                t = part["t_ms"].to_numpy(dtype=float)
                i = np.searchsorted(starts, t, "right") - 1
                inside = (i >= 0) & (t <= ends[np.maximum(i, 0)])
                kept = part[inside]
                counters = [(counter, [(c, kept[c].tolist()) for c in cols]) for counter, cols in SAMPLE_COUNTERS.items()]
                offset = self.offset_ns.get(int(rank), 0)
                for i, (t_ms, device) in enumerate(zip(kept["t_ms"].tolist(), kept["device"].tolist())):
                    at = _ns(t_ms)
                    if at is None:
                        self.left_out += 1
                        continue
                    pid = self.process(device)
                    ts = _us(at + offset)
                    for counter, cols in counters:
                        args = ",".join(f'"{c}":{values[i]!r}' for c, values in cols
                                        if isinstance(values[i], (int, float)) and math.isfinite(values[i]))
                        if args:
                            self.out.event(f'{{"ph":"C","name":"{counter}","pid":{pid},"ts":{ts},"args":{{{args}}}}}')


def _distributed_info(run: StoredRun, ranks: list[int]) -> dict[str, Any] | None:
    """Kineto's distributedInfo for a rank's file (every rank's, without ``rank``, for a file of several)."""
    if run.meta.get("rank") is None and run.ranks == 1:
        return None
    args = run.meta.get("workload_args") or {}
    info = dict(args.get("distributedInfo") or {}) if isinstance(args.get("distributedInfo"), dict) else {}
    if not info:
        info = {"backend": args.get("backend"), "world_size": run.meta.get("world_size") or run.ranks}
    info.pop("rank", None)
    if len(ranks) == 1:
        info["rank"] = ranks[0]
    else:
        info["ranks"] = ranks
    return _clean(info)


def write_trace(run: StoredRun, target: str | os.PathLike[str] | IO[bytes], plan: TracePlan | None = None,
                ranks: list[int] | None = None, gz: bool | None = None, files: Outputs | None = None) -> TraceWritten:
    """Write one trace file of ``run``: the plan's steps (``plan_trace(run)`` by default) of the given ranks' files
    (every file by default: a distributed run's ranks side by side).

    Args:
        run: the run, as ``load_run`` opened it.
        target: a path (gzip when it ends in ``.gz``), or a binary stream (``gz`` says whether to gzip).
        plan: which steps (``plan_trace``).
        ranks: the ranks whose files go in (a distributed run; None: all).
        gz: gzip the stream; by default, when the path ends in ``.gz``.
        files: where a path is written (dpprof.outputs: whole, or not at all), given its name when ``files``
            ends well; by default its own, ending here.

    Returns:
        what was written: events, bytes, seconds.

    Raises:
        OutputError: the path cannot be written (one line: the path and why); nothing was left.
    """
    t0 = time.perf_counter()
    plan = plan if plan is not None else plan_trace(run)
    paths = [p for p in run.paths if ranks is None or run._file_rank(p) in ranks]
    view = run if len(paths) == len(run.paths) else StoredRun(path=paths[0], meta=run.meta, paths=paths, read=run.read)
    path = None if hasattr(target, "write") else Path(target)
    if gz is None:
        gz = path is not None and is_gzip_name(path.name)
    # a path is written under a hidden name and takes its own only whole: a failed export leaves no half file
    own = Outputs() if path is not None and files is None else contextlib.nullcontext(files)
    with own as files:
        stream = files.open(path) if path is not None else target
        out = _Out(stream, gz)
        writer = _TraceWriter(run, view, plan, out)
        model = run.model
        head: dict[str, Any] = {"schemaVersion": 1}
        gpus = writer.gpus()
        props = _device_properties(run, gpus)
        if props:
            head["deviceProperties"] = props
        info = _distributed_info(run, writer.ranks)
        if info:
            head["distributedInfo"] = info
        head[EXPORT_KEY] = {
            "version": EXPORT_VERSION, "run": run.id, "name": run.meta.get("name"),
            "workload": run.meta.get("workload"), "kind": model.kind,
            "title": model.title, "devices": writer.devices, "gpus": gpus, "ranks": writer.ranks if info else [],
            "steps": {"recorded": plan.run_steps, "damaged": plan.damaged_steps, "held_in_full": plan.held,
                      "written": int(len(plan.steps)),
                      "ranges": plan.ranges, "asked": _asked_text(plan.asked) or None, "cut_to_fit": plan.cut,
                      "why": plan.why()},
            "detail": model.detail_text() or "every step keeps its detail",
            "clock": ("ts and dur are microseconds since baseTimeNanoseconds, when the run (its first rank) started"
                      + ("; each rank's clock is placed by its file's created_at" if len(writer.ranks) > 1 else "")),
            "threads": f"the device of each thread id: {THREADS_KEY}, after traceEvents",
        }
        inventory = _inventory(view, writer.devices)
        if inventory:
            head[EXPORT_KEY]["inventory"] = inventory
        loaders = view.data_loaders()
        if loaders:  # each rank's DataLoaders (dpprof.loaders): the data_loading finding reads them back
            head[EXPORT_KEY]["data_loaders"] = {str(rank): found for rank, found in loaders.items()}
        if model.sharded:  # an imported trace of a job sharded with FSDP: its FSDP ranges are not written
            head[EXPORT_KEY]["fsdp"] = True
        if run.damage:  # values of the run file the store read as missing or left out (dpprof.store.validation)
            head[EXPORT_KEY]["damaged"] = run.damage
        if writer.host is not None:  # Kineto's host_name: the machine of every rank in the file
            head["host_name"] = writer.host
        head.update({"traceName": f"dpprof run {run.id}", "displayTimeUnit": "ms", "baseTimeNanoseconds": writer.base_ns})
        out.text("{\n" + "".join(f"{json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))},\n"
                                  for k, v in head.items()) + '"traceEvents": [\n')
        writer.write()
        left_out = plan.left_out_text(writer.left_out)
        said = f',\n"dpprofLeftOut": {json.dumps(left_out)}' if left_out else ""
        out.text(f"\n],\n{json.dumps(THREADS_KEY)}: {json.dumps(writer.lanes.device_of)}{said}\n}}\n")
        out.close()
        size = stream.tell() if path is not None else out.bytes
    return TraceWritten(path=path, events=out.events, json_bytes=out.bytes, file_bytes=size,
                        seconds=time.perf_counter() - t0, ranks=writer.ranks, left_out=left_out)


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """A rank's file beside ``path``: trace.json.gz -> trace.rank1.json.gz (the name dpprof import reads a rank from)."""
    p = Path(path)
    name, suffix = p.name, trace_suffix(p.name)
    if suffix is not None:
        return p.with_name(f"{name[:-len(suffix)]}.rank{rank}{suffix}")
    return p.with_name(f"{name}.rank{rank}")


def export_trace(run: StoredRun, path: str | os.PathLike[str], steps: tuple[int | None, int | None] | None = None,
                 one_file: bool = False, plan: TracePlan | None = None,
                 files: Outputs | None = None) -> tuple[TracePlan, list[TraceWritten]]:
    """``dpprof export RUN --trace FILE``: the run as a trace file, or a distributed run as a file per rank (as
    torch.profiler writes them: ``FILE.rank<N>.json[.gz]``; ``one_file`` puts every rank in ``FILE``, for viewing).
    Every file whole or none (``files``, dpprof.outputs; by default its own).

    Example:
        >>> plan, written = export_trace(dpprof.load_run("20261123-215701-2e76d9"), "run.json.gz")
        >>> plan.why(), written[0].events
    """
    plan = plan if plan is not None else plan_trace(run, steps)
    if files is None:  # every rank's file whole, or none
        with Outputs() as own:
            return export_trace(run, path, steps, one_file, plan, own)
    if run.ranks == 1 or one_file:
        return plan, [write_trace(run, path, plan, files=files)]
    ranks = [run._file_rank(p) for p in run.paths]
    return plan, [write_trace(run, rank_path(path, r), plan, ranks=[r], files=files) for r in ranks]


def trace_bytes(run: StoredRun, plan: TracePlan | None = None) -> bytes:
    """The run's trace (every rank in one file) as gzip'd bytes, for a download."""
    buf = io.BytesIO()
    write_trace(run, buf, plan, gz=True)
    return buf.getvalue()
