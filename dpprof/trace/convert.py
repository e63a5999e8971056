"""A collected trace file as dpprof's own records: steps, phases, GPU time, allocator memory, collectives.

Rules (each said in the run's notes when it applies):
- Steps are ``ProfilerStep#N`` ranges; else the iterations of ``DataParallel.forward`` /
  ``DistributedDataParallel.forward`` (each from one forward's start to the next's); else each ends as an
  ``Optimizer.step#`` range does (the first from the trace's start, as ``dpprof run`` cuts a script's steps); else
  the whole window is one step.
- A trace of a ``dpprof.DataParallel`` has dpprof's ``dpprof.<phase>`` ranges: its phases are exact.
  The trace does not say which replica a worker thread ran, so the k-th ``dpprof.apply`` to start
  inside a ``dpprof.parallel_apply`` is device k (dpprof starts replica k's thread k-th).
- Otherwise a process's step is split as DistributedDataParallel runs are: ``data`` (DataLoader
  ranges, else the gap before the forward), ``forward`` (the wrapper's range, else up to the first
  backward op), ``backward`` (first autograd op to the last op or collective done), inside it
  ``backward_compute`` (until the last collective was launched) and ``comm_wait`` (from then until it
  completed on the GPU), and ``optimizer`` (``Optimizer.step#`` ranges). Backward's collectives are those
  launched while its ops ran (DDP's buckets'); the script's own after it (a metric all-reduced for logging) are
  no part of backward: a collective outside forward, backward and the optimizer is ``script_comm`` (the host's
  time in its op), as in a recorded rank (not in a job that shards with FSDP, whose hooks run collectives there).
- GPU time per step: each GPU's step window partitioned (``dpprof.stepmodel``, GPU_PARTS): a compute kernel
  and a collective kernel together are overlap, then computation, communication, memcpy (not under a kernel),
  memset (not under a kernel or copy), and idle: the parts sum to the window.
- Collectives: one comms row per collective kernel on the GPU (every NCCL / RCCL naming), named what it is
  (all-reduce, reduce-scatter, all-gather, all-to-all, broadcast, send/recv); the host ops only where the trace
  has no collective kernels.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dpprof.loaders import exported_loaders, of_iterators
from dpprof.records import (FSDP_ONLY_PHASES, PHASES, AllocatorRecord, CommRecord, DeviceRecord, GpuTimeRecord,
                            PhaseRecord, Record, StepRecord)
from dpprof.store.model import PROFILE_ALL_THREADS
from dpprof.stepmodel import GPU_PARTS, IDLE, part_names, partition
from dpprof.trace.collect import GPU_KINDS, Collected, collective_name, launched_us
from dpprof.trace.detail import Detail, detail_tables
from dpprof.trace.detail_events import RawDetail
from dpprof.trace.readback import EXPORT_KEY, export_info, exported_gpus, exported_inventory, exported_phases
from dpprof.trace.numbers import MAX_BYTES, MAX_GPU_INDEX, whole

__all__ = ["Converted", "convert", "process_label"]


@dataclass
class Converted:
    """One trace file's records, and what its run row needs to know."""

    records: list[Record] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dataparallel: str | None = None  # "exact" (dpprof ranges) or "torch" (DataParallel.forward, GPUs)
    detail: Detail | None = None  # operators, kernels, GPU metrics, memory over time, modules (dpprof.trace.detail)
    fsdp: bool = False  # the process shards its model with FSDP (its trace has FSDP's ranges)
    ddp_buckets: bool = False  # a DDP run dpprof exported: its collectives are its gradient buckets' all-reduces
    exported: bool = False  # a file dpprof export wrote: its phases, steps and collectives, no torch.profiler operators
    # its DataLoaders' iterators (dpprof.loaders); None where the file says nothing of them, [] where the run a dpprof
    # export was written from watched and iterated none
    data_loaders: list[dict[str, Any]] | None = None

    @property
    def gpus(self) -> list[str]:
        """The devices recorded as GPUs: those the trace shows working, and those dpprof's own file names."""
        return [r.device for r in self.records if isinstance(r, DeviceRecord) and r.kind == "cuda"]


def process_label(c: Collected, rank: int | None) -> str:
    """The device axis of a process: "rank:N" in a distributed run, else its GPU, else "cpu:0"."""
    if rank is not None:
        return f"rank:{rank}"
    return f"cuda:{c.gpus[0]}" if c.gpus else "cpu:0"


def _windows(c: Collected) -> tuple[list[tuple[int, float, float]], str | None]:
    """(step, start_us, end_us) per step, and a note when they are not ProfilerStep ranges."""
    if c.steps:
        return list(c.steps), None
    forwards = [f for f in c.forwards]
    if forwards:
        main = forwards[0].tid
        forwards = [f for f in forwards if f.tid == main]
        out = []
        for i, f in enumerate(forwards):
            end = forwards[i + 1].start_us if i + 1 < len(forwards) else max(c.last_us, f.end_us)
            out.append((i, f.start_us, end))
        return out, (f"no ProfilerStep ranges (the profiler ran without a schedule): each step is one "
                     f"{forwards[0].name}, from its start to the next one's")
    optimizer = [r for r in c.optimizer if r.tid == c.optimizer[0].tid] if c.optimizer else []
    if optimizer:
        # as `dpprof run` cuts a script's steps: each ends as an optimizer step does, the first from the trace's start
        ends = sorted(r.end_us for r in optimizer)
        out = [(i, lo, hi) for i, (lo, hi) in enumerate(zip([c.first_us] + ends[:-1], ends))]
        note = (f"no ProfilerStep ranges and no DataParallel or DistributedDataParallel forward: each step ends as "
                f"an Optimizer.step# range does ({len(ends)}), the first from the trace's start")
        tail_ms = (c.last_us - ends[-1]) / 1e3
        if tail_ms > 0:
            note += f"; the {tail_ms:,.2f} ms after the last one are in no step"
        return out, note
    if c.last_us >= c.first_us:
        return [(0, c.first_us, c.last_us)], ("no ProfilerStep ranges and no DataParallel or "
                                              "DistributedDataParallel forward: the whole trace is one step")
    return [], None


def _in(ranges: list[Any], lo: float, hi: float) -> list[Any]:
    """The ranges (sorted by start_us) that start in [lo, hi): two bisections, never a scan of them all."""
    key = lambda r: r.start_us  # noqa: E731
    return ranges[bisect.bisect_left(ranges, lo, key=key):bisect.bisect_left(ranges, hi, key=key)]


def _spread(starts: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each interval once per step window it reaches (windows sorted by start): (window index, start, end).

    Most intervals lie in one window; one that runs past a step's end (a collective still in flight) is repeated
    for each window it reaches, and ``stepmodel.partition`` clips each copy to its window."""
    reach = np.maximum.accumulate(hi)  # windows do not overlap: their ends rise with their starts
    first = np.searchsorted(reach, starts, "right")  # the first window ending after the interval starts
    last = np.searchsorted(lo, ends, "left") - 1  # the last window starting before it ends
    count = np.maximum(last - first + 1, 0)
    which = np.repeat(np.arange(len(starts)), count)
    offset = np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(first, count) + offset, starts[which], ends[which]


def _gpu_time(c: Collected, windows: list[tuple[int, float, float]], label_of: dict[int, str]) -> list[Record]:
    """Each GPU's step windows split by ``stepmodel.partition`` into GPU_PARTS (kernel + collective overlap,
    computation, communication, memcpy, memset) and idle, for every step and GPU at once; stored so that
    ``queries.gpu_time``'s derivation gives the parts (see GpuTimeRecord)."""
    gpus = sorted({g for g, _ in c.gpu})
    if not gpus or not windows:
        return []
    order = np.argsort([w[1] for w in windows], kind="stable")
    steps = np.array([windows[i][0] for i in order], dtype=np.int64)
    lo = np.array([windows[i][1] for i in order], dtype=float)
    hi = np.maximum(np.array([windows[i][2] for i in order], dtype=float), lo)
    n = len(lo)
    # one integer key per (GPU, step) window and the kinds as a categorical: partition's lookups stay numeric
    keys, kinds, starts, ends = [], [], [], []
    for g, gpu in enumerate(gpus):
        for k, kind in enumerate(GPU_KINDS):
            if (gpu, kind) not in c.gpu:
                continue
            iv = c.gpu[(gpu, kind)]
            w, s, e = _spread(np.frombuffer(iv.starts, dtype=float), np.frombuffer(iv.ends, dtype=float), lo, hi)
            keys.append(g * n + w)
            kinds.append(np.full(len(w), k, dtype=np.int8))
            starts.append(s)
            ends.append(e)
    intervals = pd.DataFrame({"key": np.concatenate(keys), "kind": pd.Categorical.from_codes(
        np.concatenate(kinds), categories=list(GPU_KINDS)), "start": np.concatenate(starts), "end": np.concatenate(ends)})
    table = pd.DataFrame({"key": np.arange(n * len(gpus)), "lo": np.tile(lo, len(gpus)), "hi": np.tile(hi, len(gpus))})
    parts = partition(table, intervals, GPU_PARTS, ["key"], rest=IDLE)
    out: list[Record] = []
    us = 1e3  # the trace's times are µs; the records' ms
    for key, window, overlap, computation, communication, memcpy, memset, idle in zip(
            parts["key"].tolist(), (parts["window_ms"] / us).tolist(),
            *[(parts[p] / us).tolist() for p in part_names(GPU_PARTS, IDLE)]):
        gpu, w = gpus[key // n], key % n
        out.append(GpuTimeRecord(
            step=int(steps[w]), device=label_of[gpu], window_ms=window, compute_ms=overlap + computation,
            communication_ms=overlap + communication, overlap_ms=overlap, memcpy_ms=memcpy, memset_ms=memset,
            idle_ms=idle))
    return out


def _allocator(c: Collected, windows: list[tuple[int, float, float]], label_of: dict[int, str]) -> list[Record]:
    out: list[Record] = []
    for gpu, (times, allocated, reserved) in sorted(c.memory.items()):
        t = np.frombuffer(times, dtype=float)
        order = np.argsort(t, kind="stable")
        t = t[order]
        a = np.frombuffer(allocated, dtype=float)[order]
        r = np.frombuffer(reserved, dtype=float)[order]
        for step, lo, hi in windows:
            i, j = np.searchsorted(t, lo, "left"), np.searchsorted(t, hi, "right")
            inside = a[i:j]
            before = a[i - 1:i]  # what was allocated as the step began
            span = np.concatenate([before, inside])
            if not len(span):
                continue
            res = np.concatenate([r[i - 1:i], r[i:j]])
            res = res[~np.isnan(res)]
            out.append(AllocatorRecord(step=step, call=0, device=label_of.get(gpu, f"cuda:{gpu}"), phase="step",
                                       allocated_bytes=int(span[-1]), peak_allocated_bytes=int(span.max()),
                                       reserved_bytes=int(res.max()) if len(res) else None))
    return out


def _host_phases(c: Collected, windows: list[tuple[int, float, float]], label: str, ms: Any) -> tuple[list[Record], list[str]]:
    """data, forward, backward (backward_compute, comm_wait), optimizer and the script's own collectives
    (script_comm) of each step of one process."""
    out: list[Record] = []
    notes: set[str] = set()
    bw_s = np.frombuffer(c.backward.starts, dtype=float)
    bw_e = np.frombuffer(c.backward.ends, dtype=float)
    order = np.argsort(bw_s, kind="stable")
    bw_s, bw_e = bw_s[order], bw_e[order]
    for step, lo, hi in windows:
        def phase(name: str, start: float, end: float) -> None:
            if end > start:
                out.append(PhaseRecord(step=step, call=0, phase=name, device=label, start_ms=ms(start),
                                       duration_ms=(end - start) / 1e3))
        i, j = np.searchsorted(bw_s, lo, "left"), np.searchsorted(bw_s, hi, "left")
        # backward's first op start and last op end in the step, where it has any
        b0, b1 = (float(bw_s[i]), float(bw_e[i:j].max())) if j > i else (None, None)
        data = _in(c.data, lo, hi)
        for r in data:
            phase("data", r.start_us, r.end_us)
        forwards = _in(c.forwards, lo, hi)
        busy = []  # forward's and the optimizer's spans: a collective inside them is theirs, not the script's
        if forwards:
            if not data and forwards[0].start_us > lo:
                phase("data", lo, forwards[0].start_us)
            for f in forwards:
                phase("forward", f.start_us, f.end_us)
                busy.append((f.start_us, f.end_us))
        elif b0 is not None:
            start = max([r.end_us for r in data], default=lo)
            phase("forward", start, b0)
            busy.append((start, b0))
            notes.add("forward: no DataParallel or DistributedDataParallel forward range, so forward is from the "
                      "step's start (after loading data) to its first backward op")
        if b0 is not None and b1 is not None:
            # backward's collectives: those launched while it ran (DDP's buckets' from its autograd hooks); one the
            # script launches after it (a metric all-reduced for logging after the optimizer step) is the script's,
            # and stretched backward, its compute, over all the host did before it
            # launched: by their c10d op where the trace pairs them (gloo's worker thread may start a bucket's op
            # after backward's last op, its threads still busy with earlier buckets waiting for a slower rank)
            colls = [x for x in _in(c.collectives, b0, hi) if b0 <= launched_us(x) <= b1]
            if colls:
                last_launch = min(hi, max(launched_us(x) for x in colls))
                # the last collective's end, in the step: a kernel that runs on past it waits in the next step; a host
                # op (gloo's, no kernel) ends for the host where its optimizer starts (its thread stamps the op's end
                # after the main thread went on: 0.4 ms past the optimizer's start under load)
                optimizer = [r.start_us for r in _in(c.optimizer, b1, hi)]
                cap = min(optimizer, default=hi)
                done = max(last_launch, min(hi, max((x.kernel_end_us or min(x.end_us, cap)) for x in colls)))
                phase("backward", b0, max(b1, done))
                phase("backward_compute", b0, last_launch)
                phase("comm_wait", last_launch, done)
            else:
                phase("backward", b0, b1)
                phase("backward_compute", b0, b1)
        for r in _in(c.optimizer, lo, hi):
            phase("optimizer", r.start_us, r.end_us)
            busy.append((r.start_us, r.end_us))
        if not c.fsdp_ranges:  # FSDP's collectives run outside these ranges too (its hooks'): none is the script's
            for x in _in(c.collectives, lo, hi):
                # the script's own: outside forward, backward and the optimizer (a metric all-reduced after the
                # optimizer step), the host's time in it as a recorded rank's script_comm (its launch, on NCCL)
                t = launched_us(x)
                if not (b0 is not None and b1 is not None and b0 <= t <= b1) and not any(a <= t < b for a, b in busy):
                    phase("script_comm", x.start_us, min(x.end_us, hi))
    return out, sorted(notes)


def _dataparallel_phases(c: Collected, windows: list[tuple[int, float, float]], devices: list[str],
                         ms: Any) -> list[Record]:
    """dpprof's own phases from its ``dpprof.<phase>`` ranges (a profiled dpprof.DataParallel)."""
    out: list[Record] = []
    ranges = [r for r in c.dpprof_ranges if r.name in PHASES]
    applies = [r for r in ranges if r.name == "apply"]
    for step, lo, hi in windows:
        forwards = [f for f in _in(c.forwards, lo, hi) if f.name == "DataParallel.forward"]
        starts = [f.start_us for f in forwards]

        def call_of(t: float) -> int:
            return max(0, sum(1 for s in starts if s <= t) - 1)

        pas = [r for r in _in(ranges, lo, hi) if r.name == "parallel_apply"]
        for r in _in(ranges, lo, hi):
            if r.name == "apply":
                if not any(p.start_us <= r.start_us and r.end_us <= p.end_us for p in pas):
                    # one device (or none): DataParallel calls the module itself, no parallel_apply
                    out.append(PhaseRecord(step=step, call=call_of(r.start_us), phase="apply", device=devices[0],
                                           start_ms=ms(r.start_us), duration_ms=(r.end_us - r.start_us) / 1e3))
                continue
            out.append(PhaseRecord(step=step, call=call_of(r.start_us), phase=r.name, device=devices[0],
                                   start_ms=ms(r.start_us), duration_ms=(r.end_us - r.start_us) / 1e3))
            if r.name == "parallel_apply":
                inside = _in(applies, r.start_us, r.end_us)
                for k, a in enumerate(inside[:len(devices)]):
                    out.append(PhaseRecord(step=step, call=call_of(r.start_us), phase="apply", device=devices[k],
                                           start_ms=ms(a.start_us), duration_ms=(a.end_us - a.start_us) / 1e3))
    return out


def _device_records(c: Collected, devices: list[str], gpu_of: dict[str, int]) -> list[Record]:
    """Each device's inventory row, from the trace's deviceProperties where it has them: a figure there that is not
    a whole number in range (or a name that is not a string) is unknown, never stored."""
    listed = c.meta.get("deviceProperties")
    props: dict[int, dict] = {}
    for p in listed if isinstance(listed, list) else []:
        if isinstance(p, dict) and (gpu := whole(p.get("id"), 0, MAX_GPU_INDEX)) is not None:
            props.setdefault(gpu, p)
    # a file dpprof exported also names what deviceProperties cannot hold: each device's whole inventory row
    inventory = exported_inventory(export_info(c.meta) or {})
    out: list[Record] = []
    for label in devices:
        gpu = gpu_of.get(label)
        p = props.get(gpu, {}) if gpu is not None else {}
        known = dict(inventory.get(label, {}))
        if gpu is None:
            out.append(DeviceRecord(device=label, **{"kind": "cpu", **known}))
        else:
            known.pop("kind", None)  # a GPU is what the trace shows it to be
            major, minor = whole(p.get("computeMajor"), 0, 1000), whole(p.get("computeMinor"), 0, 1000)
            name = p.get("name") if isinstance(p.get("name"), str) else c.gpu_labels.get(gpu)
            traced = dict(name=name, total_memory_bytes=whole(p.get("totalGlobalMem"), 0, MAX_BYTES),
                          multiprocessor_count=whole(p.get("numSms"), 0, MAX_GPU_INDEX),
                          capability=f"{major}.{minor}" if major is not None and minor is not None else None)
            out.append(DeviceRecord(device=label, kind="cuda",
                                    **{**known, **{k: v for k, v in traced.items() if v is not None}}))
    return out


def convert(c: Collected, t0_us: float, rank: int | None) -> Converted:
    """One file's records, times in ms since ``t0_us`` (the run's earliest step start across its files).

    Args:
        c: the collected file.
        t0_us: the run's time origin, in the trace's microseconds.
        rank: the file's rank in a distributed run (its device axis is then "rank:N"), else None.
    """
    out = Converted(data_loaders=of_iterators(r.name for r in c.data) or None)

    def ms(t: float) -> float:
        return (t - t0_us) / 1e3

    windows, note = _windows(c)
    out.notes += c.notes  # what the rules for repeated, overlapping steps and impossible numbers did
    if note:
        out.notes.append(note)
    gpus = c.gpus
    # a dpprof.DataParallel: parallel_apply over several devices, or scatter then apply on one
    dp_exact = any(r.name in ("parallel_apply", "scatter") for r in c.dpprof_ranges) and rank is None
    if export_info(c.meta) is not None:  # a file dpprof export wrote: it names each thread's device
        out.exported = True
        out.data_loaders = exported_loaders(c.meta[EXPORT_KEY], rank)
        devices, phases = exported_phases(c, windows, ms)
        label_of = {g: f"cuda:{g}" for g in gpus}
        out.records += phases
        if any(isinstance(p, PhaseRecord) and p.phase == "apply" for p in phases):
            out.dataparallel = "exact"
        out.notes.append("written by dpprof export: each dpprof.<phase> range is that phase on the device its "
                         "thread belongs to (the file's dpprofThreads); forward calls and dpprof's memory "
                         "accounting are not in the file")
        if c.meta[EXPORT_KEY].get("kind") == "fsdp" or any(
                isinstance(p, PhaseRecord) and p.phase in FSDP_ONLY_PHASES for p in phases):
            out.fsdp = True  # an FSDP run's file: its waits and copies read back, and its collectives below
            out.notes.append("an FSDP run dpprof exported: its phases (copy_in, all_gather_wait, copy_out, "
                             "reduce_scatter_wait) and its all-gathers and reduce-scatters read back; its sharded "
                             "and gathered bytes (dpprof's memory accounting) are not in the file")
        elif c.meta[EXPORT_KEY].get("kind") == "ddp":
            out.ddp_buckets = True
        elif c.meta[EXPORT_KEY].get("fsdp") is True:  # an imported trace of an FSDP job, exported again
            out.fsdp = True
            out.notes.append("an imported trace of an FSDP job that dpprof exported: its all-gathers and "
                             "reduce-scatters read back (the file has no FSDP ranges of its own)")
        dp_exact = True  # the device axis is the file's: collectives go to its first device
    elif dp_exact:
        applies = [a for a in c.dpprof_ranges if a.name == "apply"]
        per_call = max((len(_in(applies, p.start_us, p.end_us))
                        for p in c.dpprof_ranges if p.name == "parallel_apply"), default=1)
        count = max(per_call, 1, len(gpus))
        devices = [f"cuda:{g}" for g in gpus[:count]] if gpus else [f"cpu:{i}" for i in range(count)]
        devices += [f"cpu:{i}" for i in range(len(devices), count)]
        label_of = {g: f"cuda:{g}" for g in gpus}
        out.dataparallel = "exact"
        if applies:
            out.notes.append("phases are dpprof's own dpprof.* ranges (a profiled dpprof.DataParallel); the trace "
                             "does not say which worker thread ran which replica, so the k-th dpprof.apply to start "
                             "in a parallel_apply is device k (dpprof starts replica k's thread k-th)")
        else:  # torch.profiler is thread-local: the replicas' threads, and their dpprof.apply ranges, were not profiled
            out.notes.append(f"phases are dpprof's own dpprof.* ranges (a profiled dpprof.DataParallel), but the trace "
                             f"has no dpprof.apply: torch.profiler did not profile the threads that run the replicas "
                             f"(it is thread-local; {PROFILE_ALL_THREADS} profiles them), so each device's apply and the "
                             f"number of devices are unknown: its parallel_apply is on {devices[0]}")
        out.records += _dataparallel_phases(c, windows, devices, ms)
    else:
        label = process_label(c, rank)
        label_of = {g: (label if rank is not None else f"cuda:{g}") for g in gpus}
        devices = sorted(set(label_of.values()), key=lambda d: (len(d), d)) if gpus else [label]
        if label not in devices:
            devices.insert(0, label)
        phases, notes = _host_phases(c, windows, label, ms)
        out.records += phases
        out.notes += notes
        if any(f.name == "DataParallel.forward" for f in c.forwards) and len(gpus) > 1:
            out.dataparallel = "torch"
            out.notes.append("torch.nn.DataParallel on several GPUs without dpprof's ranges: its scatter, replicate, "
                             "apply and gather are not split out (the host phases and each GPU's time are)")
        if rank is not None and len(gpus) > 1:
            out.notes.append(f"rank {rank}'s trace shows {len(gpus)} GPUs: their activity is summed onto {label}")
    out.devices = devices
    # the operators, kernels and memory first: what collect kept for them goes before the GPU time's arrays come
    out.detail = detail_tables(c.detail, windows, t0_us, label_of, process_label(c, rank) if not dp_exact
                               else devices[0], gpu_memory=c.memory, cumulative_gpus=c.memory_cumulative)
    c.detail = RawDetail()
    out.notes += out.detail.notes
    gpu_of = {label_of[g]: g for g in gpus}
    if export_info(c.meta) is not None:  # dpprof's file names its GPUs, a rank's too (its file may show none)
        gpu_of = {**exported_gpus(c.meta[EXPORT_KEY]), **gpu_of}
    out.records += _gpu_time(c, windows, label_of)
    out.records += _allocator(c, windows, label_of)
    if c.memory_cumulative:
        out.notes.append("allocated bytes are the running sum of the trace's [memory] events (this format has no "
                         "Total Allocated): what was allocated before the profiler started is not counted, and "
                         "reserved bytes are unknown")
    elif not c.memory and gpus:  # a CPU-only trace: the note below says it; its own [memory] events are the host's
        out.notes.append("no GPU [memory] events (profile_memory=False): the GPUs' allocator memory is not in this "
                         "trace")
    if not gpus:
        out.notes.append("no GPU activity in this trace (a CPU-only process): no kernel, idle or overlap times")
    label = process_label(c, rank) if not dp_exact else devices[0]
    out.records += _comms(c, windows, label, label_of, ms)
    if c.fsdp_ranges:
        out.fsdp = True
        kinds = sorted({r.collective for r in out.records if isinstance(r, CommRecord) and r.collective})
        out.notes.append(f"FSDP: {c.fsdp_ranges:,} FSDP ranges (FSDP::*, FullyShardedDataParallel.*); its collectives "
                         f"are each under its own name ({', '.join(kinds) or 'none in the steps'})")
    for step, lo, hi in windows:
        fw = len(_in(c.forwards, lo, hi))
        out.records.append(StepRecord(step=step, start_ms=ms(lo), duration_ms=(hi - lo) / 1e3,
                                      batch_size=c.batch_sizes.get(step),
                                      devices_used=len(devices), forward_calls=fw, explicit=bool(c.steps)))
    out.records += _device_records(c, devices, gpu_of)
    return out


_P2P = frozenset({"all-to-all", "send/recv", "gather", "scatter"})  # what NCCL runs as SendRecv kernels


def _comms(c: Collected, windows: list[tuple[int, float, float]], label: str, label_of: dict[int, str],
           ms: Any) -> list[Record]:
    """One CommRecord per collective, named what it is (collect.collective_name): each collective kernel on the
    GPU (its start and length) where the trace has any, else each host op (``nccl:all_reduce``: its launch to its
    kernel's end, else its own end). A kernel's name comes from its "Collective name" arg, else its own name; a
    SendRecv kernel takes the name of the latest all-to-all, send, recv, gather or scatter op launched before it
    (NCCL runs those as SendRecv), an unnamed one that of the latest op of any kind. Bytes: the kernel's message,
    else its op's. ``bucket``: its place among the step's collectives on its device, or in a file dpprof exported
    the run's own (args.bucket: a DDP bucket's index, an FSDP collective's among those of its kind)."""
    step_of = _stepper(windows)
    counts: dict[tuple[int, str], int] = {}
    out: list[Record] = []
    own = export_info(c.meta) is not None  # dpprof's file: each collective's bucket is the run's (args.bucket)

    def record(step: int | None, device: str, nbytes: int | None, start: float, end: float, what: str,
               bucket: int | None = None) -> None:
        if step is None:
            return
        k = counts[(step, device)] = counts.get((step, device), -1) + 1
        out.append(CommRecord(step=step, device=device, bucket=bucket if own and bucket is not None else k,
                              bucket_bytes=nbytes, launch_ms=ms(start), duration_ms=(end - start) / 1e3,
                              collective=what))

    ops = c.collectives  # sorted by start
    if c.comm_kernels:
        op_starts = [o.start_us for o in ops]
        op_names = [collective_name(o.op or o.name) for o in ops]
        op_bytes = {o.kernel_start_us: o.bytes for o in ops if o.kernel_start_us is not None}
        for gpu, start, end, nbytes, what, _ in c.comm_kernels:
            if what in ("send/recv", "collective"):
                i = bisect.bisect_right(op_starts, start) - 1
                while i >= 0 and what == "send/recv" and op_names[i] not in _P2P:
                    i -= 1
                if i >= 0:
                    what = op_names[i]
            record(step_of(start), label_of.get(gpu, label), nbytes if nbytes is not None else op_bytes.get(start),
                   start, end, what)
    else:
        for x in ops:
            end = x.kernel_end_us if x.kernel_end_us is not None else x.end_us
            record(step_of(x.start_us), label, x.bytes, x.start_us, end, collective_name(x.op or x.name), x.bucket)
    return out


def _stepper(windows: list[tuple[int, float, float]]) -> Any:
    starts = np.array([w[1] for w in windows], dtype=float)

    def step_of(t: float) -> int | None:
        if not len(starts):
            return None
        i = int(np.searchsorted(starts, t, "right")) - 1
        if i < 0:
            return None
        step, lo, hi = windows[i]
        return step if t < hi or math.isclose(t, hi) else None

    return step_of
