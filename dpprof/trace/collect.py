"""What one trace file says, gathered in one streaming pass: the few ranges that mark steps and phases,
and every GPU activity and memory reading packed into typed arrays (16-24 bytes each, never a dict).

``collect(trace)`` consumes ``TraceFile.events()`` and returns a ``Collected``; turning it into
dpprof's records is ``dpprof.trace.convert``. Numbers are checked as they are read (``dpprof.trace.numbers``
states the rules): a step with a time that cannot be, or a step number past 2**53, stops the import with one
line naming the event; any other event with such a time is left out and counted; repeated and overlapping steps
follow the rules written there, said in ``Collected.notes``.
"""
from __future__ import annotations

import bisect
import math
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dpprof.records import ALL_REDUCE, SCRIPT_BUCKET
from dpprof.trace.numbers import (MAX_BYTES, MAX_GPU_INDEX, MAX_STEP, MAX_STEP_DIGITS, MAX_TIME_US,
                                  base_time_problem, distributed_problem, is_time, shown, slack_us, time_problem, whole)
from dpprof.trace.decode import Event, OddEvent, TraceError, TraceFile
from dpprof.trace.detail_events import LAUNCH_CATS, OP_CATS, DetailCollector, RawDetail, merge_details

__all__ = ["Range", "Collective", "Collected", "collect", "collect_part", "merge_parts", "finish", "DTYPE_BYTES",
           "gpu_kind", "Args", "args_of", "collective_name", "COLLECTIVES"]

# Bytes per element of the dtypes collectives name ("dtype": "Float"; "Input type": "float").
DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "long": 8, "int64": 8, "long int": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "byte": 1,
    "unsigned char": 1, "uint8": 1, "char": 1, "signed char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "complexfloat": 8, "complexdouble": 16,
}
_CPU_CATS = frozenset({"cpu_op", "user_annotation", "Operator", "python_function"})
_KERNEL_CATS = frozenset({"kernel", "Kernel"})
_MEMCPY_CATS = frozenset({"gpu_memcpy", "Memcpy"})
_MEMSET_CATS = frozenset({"gpu_memset", "Memset"})
_STEP = re.compile(r"ProfilerStep#([0-9]+)")  # fullmatch: ASCII digits only, no newline after them
_COLLECTIVE = re.compile(r"^(nccl|gloo|mpi|ucc|xccl):")
# torch's c10d op that launched a collective (c10d::_reduce_scatter_base_): what it is where the backend's op is
# named otherwise (gloo runs a reduce-scatter as gloo:all_reduce)
_C10D = "c10d::"
# FSDP's ranges: FSDP2 (fully_shard) names FSDP::pre_forward, FSDP::all_gather, ...; FSDP1 FullyShardedDataParallel.*
_FSDP = ("FSDP::", "FullyShardedDataParallel.")
# Backward ops: the autograd engine's per-function ranges (torch >= 1.10), else the older names of
# the backward functions themselves (the 2021 format: "CudnnConvolutionBackward").
_BACKWARD = re.compile(r"^autograd::engine::evaluate_function|Backward\d*$|^torch::autograd::AccumulateGrad$")
WRAPPER_FORWARDS = ("DataParallel.forward", "DistributedDataParallel.forward")
# What a collective is, from its op's name (nccl:_reduce_scatter_base), its kernel's (ncclDevKernel_AllGather_RING_LL,
# RCCL's the same) or the kernel's "Collective name" arg (allreduce): the first pattern found in the name, once
# lower-cased and stripped of "_", "-" and " ", wins (reduce-scatter before all-reduce's "reduce").
COLLECTIVES = (("reducescatter", "reduce-scatter"), ("allreduce", ALL_REDUCE), ("allgather", "all-gather"),
               ("alltoall", "all-to-all"), ("broadcast", "broadcast"), ("sendrecv", "send/recv"),
               ("send", "send/recv"), ("recv", "send/recv"), ("barrier", "barrier"), ("reduce", "reduce"),
               ("gather", "gather"), ("scatter", "scatter"))
_KERNEL_PREFIX = re.compile(r"^(?:void\s+)?(?:nccl|rccl)(?:dev)?kernel_?", re.IGNORECASE)
GPU_KINDS = ("compute", "communication", "memcpy", "memset")


@dataclass(frozen=True, slots=True)
class Range:
    """A CPU range from the trace, in the trace's microseconds."""

    name: str
    start_us: float
    end_us: float
    tid: Any


@dataclass(slots=True)
class Collective:
    """One collective op on the CPU (``nccl:all_reduce``), and what its GPU kernel says once paired."""

    name: str
    start_us: float
    end_us: float
    bytes: int | None
    kernel_start_us: float | None = None
    kernel_end_us: float | None = None
    op: str | None = None  # the c10d op that launched it (c10d::_reduce_scatter_base_), where the trace pairs them
    # that c10d op's start: when the process launched it (gloo's worker thread starts its op later, after backward's
    # last op when its threads are busy with earlier buckets)
    launch_us: float | None = None
    bucket: int | None = None  # its args.bucket: in a file dpprof export wrote, the run's own index of it in its step


class _Intervals:
    """start/end pairs in two typed arrays (16 bytes an interval)."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")

    def add(self, start: float, end: float) -> None:
        self.starts.append(start)
        self.ends.append(end)

    def __len__(self) -> int:
        return len(self.starts)


@dataclass
class Collected:
    """One trace file's steps, phase ranges, collectives, GPU activity and memory readings."""

    name: str
    size_bytes: int
    meta: dict[str, Any]
    events: int = 0
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (N, start_us, end_us) of ProfilerStep#N
    batch_sizes: dict[int, int] = field(default_factory=dict)  # N -> its ProfilerStep's args.batch_size (dpprof's file)
    forwards: list[Range] = field(default_factory=list)  # DataParallel.forward / DistributedDataParallel.forward
    dpprof_ranges: list[Range] = field(default_factory=list)  # dpprof.<phase>
    optimizer: list[Range] = field(default_factory=list)  # Optimizer.step#...
    data: list[Range] = field(default_factory=list)  # enumerate(DataLoader)#...
    backward: _Intervals = field(default_factory=_Intervals)  # autograd ops
    collectives: list[Collective] = field(default_factory=list)
    c10d: list[Range] = field(default_factory=list)  # c10d::<collective> ops, the launches of the collectives
    fsdp_ranges: int = 0  # FSDP's ranges seen (FSDP::*, FullyShardedDataParallel.*): the job shards with FSDP
    # (gpu, start, end, bytes, what: collective_name of its "Collective name" arg or its kernel's name, External id:
    # the CPU op that launched it, a record_param_comms op around or inside its collective op, or None)
    comm_kernels: list[tuple[int, float, float, int | None, str, int | None]] = field(default_factory=list)
    # a record_param_comms op's External id -> its start and end (the collective's op runs inside it, or it inside that)
    comm_launches: dict[int, tuple[float, float]] = field(default_factory=dict)
    gpu: dict[tuple[int, str], _Intervals] = field(default_factory=dict)  # (gpu, kind) -> intervals
    memory: dict[int, tuple[array, array, array]] = field(default_factory=dict)  # gpu -> ts, allocated, reserved
    memory_cumulative: set[int] = field(default_factory=set)  # GPUs whose allocated bytes are summed from Bytes
    # gpu -> each reading's Bytes where its allocated bytes were summed from them (NaN where Total Allocated gave
    # them): what merge_parts sums again across parts
    memory_summed: dict[int, array] = field(default_factory=dict)
    first_us: float = float("inf")
    last_us: float = float("-inf")
    gpu_labels: dict[int, str] = field(default_factory=dict)  # pid -> "GPU 0"
    left_out: int = 0  # events left out for a time or number that cannot be (dpprof.trace.numbers)
    left_out_first: str = ""  # the first of them, and why
    notes: list[str] = field(default_factory=list)  # what the rules for steps and left-out events did
    detail: RawDetail = field(default_factory=RawDetail)  # operators, kernels, memory events (dpprof.trace.detail)

    @property
    def gpus(self) -> list[int]:
        return sorted({g for g, _ in self.gpu} | set(self.memory))

    @property
    def rank(self) -> int | None:
        """distributedInfo's rank (checked by ``collect``: a whole number), else None."""
        info = self.meta.get("distributedInfo")
        return int(info["rank"]) if isinstance(info, dict) and info.get("rank") is not None else None

    @property
    def world_size(self) -> int | None:
        """distributedInfo's world_size (checked by ``collect``), else None."""
        info = self.meta.get("distributedInfo")
        return int(info["world_size"]) if isinstance(info, dict) and info.get("world_size") is not None else None


def collective_name(name: str) -> str:
    """all-reduce, reduce-scatter, all-gather, all-to-all, broadcast, send/recv, ... for a collective's op name
    (``nccl:all_reduce``), kernel name (``ncclKernel_AllReduce_RING_LL_Sum_float``) or "Collective name" arg;
    "collective" when none of COLLECTIVES is in it (NCCL's ``ncclDevKernel_Generic``)."""
    text = name.split("(", 1)[0]
    text = text.split(":", 1)[1] if ":" in text and not text.startswith("void") else text
    match = _KERNEL_PREFIX.match(text)
    if match:  # a kernel: its first word is the collective (ncclKernel_AllReduce_RING_LL_Sum_float)
        text = text[match.end():].split("_", 1)[0]
    flat = text.lower().replace("_", "").replace("-", "").replace(" ", "")
    return next((canonical for key, canonical in COLLECTIVES if key in flat), "collective")


def gpu_kind(cat: str, name: str) -> str | None:
    """compute, communication, memcpy or memset for a GPU activity; None for anything else."""
    if cat in _KERNEL_CATS:
        low = name.lower()
        return "communication" if ("nccl" in low or "gloo" in low or "rccl" in low) else "compute"
    if cat in _MEMCPY_CATS:
        return "memcpy"
    if cat in _MEMSET_CATS:
        return "memset"
    return None


class Args(msgspec.Struct, gc=False):
    """The fields of an event's ``args`` that dpprof reads (any JSON type each); the rest are skipped unread."""

    device: Any = None
    in_msg_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    dtype: Any = None
    input_dims: Any = msgspec.field(default=None, name="Input Dims")
    input_type: Any = msgspec.field(default=None, name="Input type")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    bytes: Any = msgspec.field(default=None, name="Bytes")
    labels: Any = None
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    external_id: Any = msgspec.field(default=None, name="External id")
    batch_size: Any = None  # a ProfilerStep's in a file dpprof export wrote
    bucket: Any = None  # a collective's in a file dpprof export wrote


NO_ARGS = Args()
_decode_args = msgspec.json.Decoder(Args).decode


def args_of(event: Event | OddEvent) -> Args:
    """The event's args as far as dpprof reads them; ``NO_ARGS`` where there are none or they are not an object."""
    try:
        return _decode_args(event.args)
    except (msgspec.DecodeError, RecursionError):  # args nested deeper than the decoder goes: none dpprof reads
        return NO_ARGS


def _message_bytes(args: Args) -> int | None:
    """Bytes a collective moves: In msg nelems x dtype size, else its input's dims x type size.
    Unknown (None) where a count is not a whole number or the total is past MAX_BYTES."""
    nelems, dtype = args.in_msg_nelems, args.dtype
    if isinstance(nelems, (int, float)) and isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        count = whole(nelems, 0, MAX_BYTES)
        total = None if count is None else count * DTYPE_BYTES[dtype.lower()]
        return total if total is not None and total <= MAX_BYTES else None
    dims, types = args.input_dims, args.input_type
    if isinstance(dims, list) and isinstance(types, list) and dims and types:
        total = 0
        for shape, kind in zip(dims, types):
            size = DTYPE_BYTES.get(str(kind).lower())
            if size is None or not isinstance(shape, list):
                continue
            count = 1
            for d in shape:
                if not isinstance(d, (int, float)):
                    break
                n = whole(d, 0, MAX_BYTES)
                if n is None:
                    return None
                count = min(count * n, MAX_BYTES + 1)
            total += count * size
            if total > MAX_BYTES:
                return None
        return total or None
    return None


def _gpu_of(event: Event | OddEvent, args: Args) -> int | None:
    """The GPU of an activity: its args' device, else its pid; None where neither is a GPU index."""
    device = whole(args.device, 0, MAX_GPU_INDEX)
    return device if device is not None else whole(event.pid, 0, MAX_GPU_INDEX)


def _name_kind(name: str) -> tuple[str, int] | None:
    """What a CPU range's name makes it: ("step", N), ("forward",), ... or None (an op dpprof does not need)."""
    if m := _STEP.fullmatch(name):
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > MAX_STEP_DIGITS or int(digits) > MAX_STEP:
            return ("bad step", 0)
        return ("step", int(digits))
    if name.startswith("ProfilerStep#"):  # a step range with no number (a hand-edited or foreign trace): no step
        return ("unnumbered step", 0)
    if name in WRAPPER_FORWARDS:
        return ("forward", 0)
    if name.startswith("dpprof."):
        return ("dpprof", 0)
    if name.startswith("Optimizer.step#"):
        return ("optimizer", 0)
    if name.startswith("enumerate(DataLoader)"):
        return ("data", 0)
    if _COLLECTIVE.match(name):
        return ("collective", 0)
    if name.startswith(_C10D) and collective_name(name) != "collective":
        return ("c10d", 0)
    if name.startswith(_FSDP):
        return ("fsdp", 0)
    if _BACKWARD.search(name):
        return ("backward", 0)
    return None


_GPU_CATS = _KERNEL_CATS | _MEMCPY_CATS | _MEMSET_CATS


def collect(trace: TraceFile) -> Collected:
    """Read the trace once and keep what dpprof's records need (see the module docstring).

    Raises:
        TraceError: the file cannot be read, or a number in it cannot be (a step's time, a step number past
            2**53, baseTimeNanoseconds, distributedInfo: ``dpprof.trace.numbers``); one line naming the event.
    """
    return finish(collect_part(trace))


def collect_part(trace: TraceFile) -> Collected:
    """What ``collect`` keeps of the events ``trace`` reads (the whole file, or one ``Span`` of it), in file order,
    before the rules that need every event of the file (``finish``): parts of one file are ``merge_parts``-ed first.

    Raises:
        TraceError: as ``collect``.
    """
    out = Collected(name=trace.name, size_bytes=trace.size_bytes, meta=trace.meta)
    gpu = out.gpu
    backward = out.backward
    kinds: dict[str, tuple[str, int] | None] = {}  # name -> _name_kind(name): names repeat, step after step
    gpu_kinds: dict[tuple[str, str], str | None] = {}  # (cat, name) -> gpu_kind(cat, name): kernels repeat too
    first_us, last_us = float("inf"), float("-inf")
    cpu_cats, gpu_cats = _CPU_CATS, _GPU_CATS
    number = (int, float)
    top = MAX_TIME_US
    detail = DetailCollector()
    on_op, on_launch, on_kernel, on_memory, on_python = (detail.op, detail.launch, detail.kernel, detail.memory,
                                                         detail.python)
    op_cats, launch_cats, kernel_cats = OP_CATS, LAUNCH_CATS, _KERNEL_CATS
    for batch in trace.batches():
        for event in batch:
            ph = event.ph
            if ph == "X":
                cat = event.cat
                if type(cat) is not str:  # a category that is a list or an object: no event dpprof reads
                    continue
                if cat in cpu_cats:
                    ts, dur = event.ts, event.dur
                    # one chained comparison per field: NaN, infinities, negative and absurd times all fail it
                    if not (isinstance(ts, number) and 0 <= ts <= top) or (
                            isinstance(dur, number) and not 0 <= dur <= top):
                        _bad_time(out, trace, batch, event, kinds)
                        continue
                    end = ts + dur if isinstance(dur, number) else ts
                    if ts < first_us:
                        first_us = ts
                    if end > last_us:
                        last_us = end
                    name = event.name
                    if not isinstance(name, str):  # odd fields are data, not errors: such an event is not one we need
                        continue
                    if cat in op_cats:
                        on_op(ts, dur if isinstance(dur, number) else None, event.tid, name, event.args)
                        if name == "record_param_comms":  # where a collective's kernel was launched (_pair_collectives)
                            ext = args_of(event).external_id
                            if type(ext) is int:
                                out.comm_launches[ext] = (float(ts), float(end))
                    elif cat == "python_function":
                        on_python(ts, dur if isinstance(dur, number) else 0, event.tid, name, event.args)
                    kind = kinds.get(name, ())
                    if kind == ():
                        kind = kinds[name] = _name_kind(name)
                    if kind is None:
                        continue
                    what = kind[0]
                    if what == "backward":
                        backward.add(ts, end)
                    elif what == "step":
                        if not isinstance(dur, number):
                            _refuse(trace, batch, event, time_problem("dur", dur))
                        out.steps.append((kind[1], float(ts), float(end)))
                        size = whole(args_of(event).batch_size, 0, MAX_STEP)
                        if size is not None:
                            out.batch_sizes.setdefault(kind[1], size)
                    elif what == "bad step":
                        _refuse(trace, batch, event, f"the step number is past 2**53 "
                                                     f"({len(name) - len('ProfilerStep#'):,} digits)")
                    elif what == "unnumbered step":
                        _left_out(out, trace, batch, event, "a ProfilerStep range with no step number")
                    elif what == "forward":
                        out.forwards.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "dpprof":
                        out.dpprof_ranges.append(Range(name[len("dpprof."):], float(ts), float(end), event.tid))
                    elif what == "optimizer":
                        out.optimizer.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "data":
                        out.data.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "c10d":
                        out.c10d.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "fsdp":
                        out.fsdp_ranges += 1
                    else:
                        op_args = args_of(event)
                        out.collectives.append(Collective(name, float(ts), float(end), _message_bytes(op_args),
                                                          bucket=whole(op_args.bucket, SCRIPT_BUCKET, MAX_STEP)))
                elif cat in gpu_cats:
                    ts, dur = event.ts, event.dur
                    if not (isinstance(ts, number) and 0 <= ts <= top) or (
                            isinstance(dur, number) and not 0 <= dur <= top):
                        _bad_time(out, trace, batch, event, kinds)
                        continue
                    end = ts + dur if isinstance(dur, number) else ts
                    name = event.name
                    if not isinstance(name, str):
                        name = "" if name is None else str(name)
                    kind = gpu_kinds.get((cat, name), ())
                    if kind == ():
                        kind = gpu_kinds[(cat, name)] = gpu_kind(cat, name)
                    args = args_of(event)
                    index = _gpu_of(event, args)
                    if index is None:
                        continue
                    if cat in kernel_cats:
                        on_kernel(ts, dur if isinstance(dur, number) else 0, index, name, event.args, event.tid)
                    key = (index, kind)
                    if key not in gpu:
                        gpu[key] = _Intervals()
                    gpu[key].add(ts, end)
                    if kind == "communication":
                        what = args.collective_name if isinstance(args.collective_name, str) else name
                        ext = args.external_id
                        out.comm_kernels.append((index, float(ts), float(end), _message_bytes(args),
                                                 collective_name(what), ext if type(ext) is int else None))
                elif cat in launch_cats:
                    ts = event.ts
                    if isinstance(ts, number) and 0 <= ts <= top:
                        on_launch(ts, event.tid, event.name if isinstance(event.name, str) else "", event.args)
            elif ph == "i" and event.name == "[memory]":
                why = _memory(out, event)
                if why:
                    _left_out(out, trace, batch, event, why)
                else:
                    on_memory(event.ts, event.tid, event.args)
            elif ph == "M" and event.name == "process_labels":
                labels = args_of(event).labels
                pid = whole(event.pid, 0, MAX_GPU_INDEX)
                if isinstance(labels, str) and labels.startswith("GPU") and pid is not None:
                    out.gpu_labels[pid] = labels
    out.first_us, out.last_us = float(first_us), float(last_us)
    out.events = trace.events_read
    out.detail = detail.raw(trace.meta)
    return out


def finish(out: Collected) -> Collected:
    """The rules over a whole file's events, once (``collect``, or after ``merge_parts``): its top-level fields
    checked, steps in order with one range each, ranges sorted, collectives named and paired with their kernels.

    Raises:
        TraceError: baseTimeNanoseconds or distributedInfo cannot be (``dpprof.trace.numbers``).
    """
    for problem in (base_time_problem(out.meta), distributed_problem(out.meta)):
        if problem:
            raise TraceError(f"{out.name}: {problem}")
    out.steps.sort(key=lambda s: s[1])
    _one_range_per_step(out)
    if out.left_out:
        out.notes.append(f"{out.left_out:,} event{'s' if out.left_out > 1 else ''} with a time or number that "
                         f"cannot be (not a number, NaN, infinite, negative, or past 2**52 µs) left out: the first, "
                         f"{out.left_out_first}")
    out.forwards.sort(key=lambda r: r.start_us)
    out.dpprof_ranges.sort(key=lambda r: r.start_us)
    out.optimizer.sort(key=lambda r: r.start_us)
    out.data.sort(key=lambda r: r.start_us)
    out.collectives.sort(key=lambda c: c.start_us)
    out.comm_kernels.sort(key=lambda k: k[1])
    out.c10d.sort(key=lambda r: r.start_us)
    _name_by_c10d(out)
    _pair_collectives(out)
    return out


def merge_parts(parts: list[Collected]) -> Collected | None:
    """One file's ``collect_part`` results, its parts in file order, as one ``collect_part`` of the whole file would
    have made them; ``finish`` it next. The 2021 format's running sum of allocations (each part's starts at zero) is
    summed again over the whole file. None where that cannot be told from the parts alone: a later part left an event
    out (its message would number the event from the part's start); the caller reads such a file whole instead.

    The first part becomes the whole (its lists and arrays extended in place) and each later one is emptied as it is
    added, so that the file's arrays are never held twice.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.left_out for p in parts[1:]):
        return None
    out = first
    for p in parts[1:]:
        out.meta.update(p.meta)
    details = [p.detail for p in parts]
    for p in parts[1:]:
        out.events += p.events
        out.steps += p.steps
        out.batch_sizes = {**p.batch_sizes, **out.batch_sizes}
        out.forwards += p.forwards
        out.dpprof_ranges += p.dpprof_ranges
        out.optimizer += p.optimizer
        out.data += p.data
        out.backward.starts += p.backward.starts
        out.backward.ends += p.backward.ends
        out.collectives += p.collectives
        out.c10d += p.c10d
        out.fsdp_ranges += p.fsdp_ranges
        out.comm_kernels += p.comm_kernels
        out.comm_launches.update(p.comm_launches)
        for key, spans in p.gpu.items():
            mine = out.gpu.setdefault(key, _Intervals())
            mine.starts += spans.starts
            mine.ends += spans.ends
        for gpu, columns in p.memory.items():
            if gpu not in out.memory:
                out.memory[gpu] = (array("d"), array("d"), array("d"))
                out.memory_summed[gpu] = array("d")
            for mine, theirs in zip(out.memory[gpu], columns):
                mine += theirs
            out.memory_summed[gpu] += p.memory_summed[gpu]
        out.memory_cumulative |= p.memory_cumulative
        out.gpu_labels.update(p.gpu_labels)
        out.first_us = min(out.first_us, p.first_us)
        out.last_us = max(out.last_us, p.last_us)
        p.gpu, p.memory, p.memory_summed, p.backward = {}, {}, {}, _Intervals()  # added: not held twice
    for gpu in out.memory_cumulative:  # each reading summed from the one before it, across the parts
        allocated, summed = out.memory[gpu][1], out.memory_summed[gpu]
        for i, nbytes in enumerate(summed):
            if nbytes == nbytes:  # not NaN: this reading's allocated bytes are the running sum
                allocated[i] = _summed(allocated[i - 1] if i else 0.0, nbytes)
    out.detail = merge_details(details, out.meta)
    return out


def _name_by_c10d(out: Collected) -> None:
    """Give each backend collective op (gloo:all_reduce) the c10d op that launched it (c10d::_reduce_scatter_base_),
    where the trace has as many of one as of the other: the backend runs them in the order c10d launched them.
    Where the counts differ (the profiler's window cut one of a pair) each keeps its own name and start."""
    if len(out.c10d) != len(out.collectives) or not out.c10d:
        return
    for op, launch in zip(out.collectives, out.c10d):
        op.op = launch.name
        if launch.start_us <= op.start_us:  # a launch comes first: else the pairs are not what they seem
            op.launch_us = launch.start_us


def launched_us(op: Collective) -> float:
    """When the process launched a collective: its c10d op's start where the trace pairs them, else its own start."""
    return op.start_us if op.launch_us is None else op.launch_us


def _where(trace: TraceFile, batch: list, event: Any) -> str:
    """An event as a refusal names it: its name and its place in traceEvents."""
    i = next(k for k, e in enumerate(batch) if e is event)
    name = event.name if isinstance(event.name, str) else shown(event.name)
    if len(name) > 60:
        name = f"{name[:60]}…"
    return f"{name} (traceEvents[{trace.events_read - len(batch) + i:,}])"


def _refuse(trace: TraceFile, batch: list, event: Any, why: str) -> None:
    raise TraceError(f"{trace.name}: {_where(trace, batch, event)}: {why}")


def _left_out(out: Collected, trace: TraceFile, batch: list, event: Any, why: str) -> None:
    out.left_out += 1
    if out.left_out == 1:
        out.left_out_first = f"{_where(trace, batch, event)}, {why}"


def _bad_time(out: Collected, trace: TraceFile, batch: list, event: Any,
              kinds: dict[str, tuple[str, int] | None]) -> None:
    """An event whose ts or dur cannot be: a step is refused, anything else left out and counted."""
    ts, dur = event.ts, event.dur
    why = time_problem("ts", ts) if not is_time(ts) else time_problem("dur", dur)
    name = event.name
    if event.cat in _CPU_CATS and isinstance(name, str) and _STEP.fullmatch(name):
        _refuse(trace, batch, event, why)
    if ts is None:  # no time at all: not an event dpprof can place
        return
    _left_out(out, trace, batch, event, why)  # a time that cannot be (a string, NaN, negative, absurd): counted


def _one_range_per_step(out: Collected) -> None:
    """The rules for steps that repeat or overlap (``dpprof.trace.numbers``), on steps sorted by start: a number
    met again keeps its first range; a step ending after the next starts ends where it starts; one clipped to
    nothing, or of no length, is left out. Each rule that applied is said in ``out.notes``."""
    seen: set[int] = set()
    repeated: list[int] = []
    kept: list[tuple[int, float, float]] = []
    for step in out.steps:
        if step[0] in seen:
            repeated.append(step[0])
        else:
            seen.add(step[0])
            kept.append(step)
    clipped: list[int] = []
    empty: list[int] = []
    steps: list[tuple[int, float, float]] = []
    for i, (n, lo, hi) in enumerate(kept):
        if i + 1 < len(kept) and hi > kept[i + 1][1]:
            if hi - kept[i + 1][1] > slack_us(hi):  # past the next step's start by more than ts + dur's rounding
                clipped.append(n)
            hi = kept[i + 1][1]
        if hi > lo:
            steps.append((n, lo, hi))
        else:
            empty.append(n)
    out.steps = steps
    if repeated:
        again = sorted(set(repeated))
        out.notes.append(f"ProfilerStep#{', #'.join(map(str, again[:5]))} appear{'s' if len(again) == 1 else ''} "
                         f"more than once: the first range in time of each is kept, {len(repeated)} later left out")
    if clipped:
        out.notes.append(f"{len(clipped)} step{'s' if len(clipped) > 1 else ''} (ProfilerStep#"
                         f"{', #'.join(map(str, clipped[:5]))}) ended after the next began: each ends where the next "
                         "begins, so that steps never overlap")
    if empty:
        out.notes.append(f"{len(empty)} step{'s' if len(empty) > 1 else ''} of no length (ProfilerStep#"
                         f"{', #'.join(map(str, empty[:5]))}) left out")


def _memory(out: Collected, event: Event | OddEvent) -> str | None:
    """Keep one ``[memory]`` reading of a GPU; what is wrong with it where a number in it cannot be (it is left
    out), else None (kept, or not a GPU's)."""
    args = args_of(event)
    if args.device_type != 1:  # 0: CPU memory; 1: CUDA
        return None
    device = whole(args.device_id, 0, MAX_GPU_INDEX)
    ts = event.ts
    if device is None or not isinstance(ts, (int, float)):
        return None
    if not is_time(ts):
        return time_problem("ts", ts)
    total = args.total_allocated
    cumulative = not isinstance(total, (int, float))  # the 2021 format: only each allocation's Bytes
    if cumulative:
        nbytes = args.bytes
        if not isinstance(nbytes, (int, float)):
            return None
        if whole(nbytes, -MAX_BYTES, MAX_BYTES) is None:
            return f"Bytes {shown(nbytes)} is not a number of bytes"
    elif whole(total, 0, MAX_BYTES) is None:
        return f"Total Allocated {shown(total)} is not a number of bytes"
    if device not in out.memory:
        out.memory[device] = (array("d"), array("d"), array("d"))
        out.memory_summed[device] = array("d")
    times, allocated, reserved = out.memory[device]
    out.memory_summed[device].append(float(nbytes) if cumulative else math.nan)
    if cumulative:  # allocated is the running sum of the allocations' Bytes
        out.memory_cumulative.add(device)
        total = _summed(allocated[-1] if allocated else 0.0, nbytes)
    times.append(float(ts))
    allocated.append(float(total))
    res = whole(args.total_reserved, 0, MAX_BYTES)  # out of range: unknown, as where the format has none
    reserved.append(float(res) if res is not None else float("nan"))
    return None


def _summed(before: float, nbytes: float) -> float:
    """The allocated bytes after an allocation (or a free: negative) of ``nbytes``, in the format that gives only
    each one's Bytes: the running sum, never below 0 nor past MAX_BYTES."""
    return min(max(before + nbytes, 0.0), float(MAX_BYTES))


def _pair_collectives(out: Collected) -> None:
    """Give each collective op its communication kernel; the kernel's message size wins where the op has none.

    A kernel whose External id names a record_param_comms op (the op that launched it) goes to the collective op
    that runs inside it (nccl:all_reduce, as torch records them) or that it runs inside. Then, in order, each op left
    gets the next kernel left that starts after it (NCCL runs one kernel per collective on its own stream). Paired
    by launch, a kernel the profiler dropped costs its own op only: in order alone, every later op would take its
    neighbour's kernel."""
    kernels, ops = out.comm_kernels, out.collectives  # both sorted by start
    used = [False] * len(kernels)
    paired = [False] * len(ops)

    def pair(i: int, k: int) -> None:
        _, start, end, nbytes, _, _ = kernels[k]
        op = ops[i]
        op.kernel_start_us, op.kernel_end_us = start, end
        if op.bytes is None:
            op.bytes = nbytes
        paired[i] = used[k] = True

    launches = out.comm_launches
    if launches:
        starts = [op.start_us for op in ops]
        for k, kernel in enumerate(kernels):
            span = launches.get(kernel[5]) if kernel[5] is not None else None
            if span is None:
                continue
            lo, hi = span
            i = bisect.bisect_left(starts, lo)  # the first op begun inside it
            while i < len(ops) and starts[i] <= hi and paired[i]:
                i += 1
            if i < len(ops) and starts[i] <= hi:
                pair(i, k)
                continue
            i = bisect.bisect_right(starts, lo) - 1  # else the latest op begun before it that holds it
            while i >= 0 and (ops[i].end_us < lo or paired[i]):
                i -= 1
            if i >= 0:
                pair(i, k)
    k = 0
    for i, op in enumerate(ops):
        if paired[i]:
            continue
        while k < len(kernels) and (used[k] or kernels[k][1] < op.start_us):
            k += 1
        if k >= len(kernels):
            break
        pair(i, k)
        k += 1