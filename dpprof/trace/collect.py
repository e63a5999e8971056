"""What one trace file says, gathered in one streaming pass: the few ranges that mark steps and phases,
and every GPU activity and memory reading packed into typed arrays (16-24 bytes each, never a dict).

``collect(trace)`` consumes ``TraceFile.events()`` and returns a ``Collected``; turning it into
dpprof's records is ``dpprof.trace.convert``.
"""
from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dpprof.trace.reader import Event, OddEvent, TraceFile

__all__ = ["Range", "Collective", "Collected", "collect", "DTYPE_BYTES", "gpu_kind", "Args", "args_of",
           "collective_name", "COLLECTIVES"]

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
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COLLECTIVE = re.compile(r"^(nccl|gloo|mpi|ucc|xccl):")
# Backward ops: the autograd engine's per-function ranges (torch >= 1.10), else the older names of
# the backward functions themselves (the 2021 format: "CudnnConvolutionBackward").
_BACKWARD = re.compile(r"^autograd::engine::evaluate_function|Backward\d*$|^torch::autograd::AccumulateGrad$")
WRAPPER_FORWARDS = ("DataParallel.forward", "DistributedDataParallel.forward")
# What a collective is, from its op's name (nccl:_reduce_scatter_base), its kernel's (ncclDevKernel_AllGather_RING_LL,
# RCCL's the same) or the kernel's "Collective name" arg (allreduce): the first pattern found in the name, once
# lower-cased and stripped of "_", "-" and " ", wins (reduce-scatter before all-reduce's "reduce").
COLLECTIVES = (("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce"), ("allgather", "all-gather"),
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
    forwards: list[Range] = field(default_factory=list)  # DataParallel.forward / DistributedDataParallel.forward
    dpprof_ranges: list[Range] = field(default_factory=list)  # dpprof.<phase>
    optimizer: list[Range] = field(default_factory=list)  # Optimizer.step#...
    data: list[Range] = field(default_factory=list)  # enumerate(DataLoader)#...
    backward: _Intervals = field(default_factory=_Intervals)  # autograd ops
    collectives: list[Collective] = field(default_factory=list)
    # (gpu, start, end, bytes, what: collective_name of its "Collective name" arg or its kernel's name)
    comm_kernels: list[tuple[int, float, float, int | None, str]] = field(default_factory=list)
    gpu: dict[tuple[int, str], _Intervals] = field(default_factory=dict)  # (gpu, kind) -> intervals
    memory: dict[int, tuple[array, array, array]] = field(default_factory=dict)  # gpu -> ts, allocated, reserved
    memory_cumulative: set[int] = field(default_factory=set)  # GPUs whose allocated bytes are summed from Bytes
    first_us: float = float("inf")
    last_us: float = float("-inf")
    gpu_labels: dict[int, str] = field(default_factory=dict)  # pid -> "GPU 0"

    @property
    def gpus(self) -> list[int]:
        return sorted({g for g, _ in self.gpu} | set(self.memory))

    @property
    def rank(self) -> int | None:
        info = self.meta.get("distributedInfo")
        return int(info["rank"]) if isinstance(info, dict) and info.get("rank") is not None else None


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


NO_ARGS = Args()
_decode_args = msgspec.json.Decoder(Args).decode


def args_of(event: Event | OddEvent) -> Args:
    """The event's args as far as dpprof reads them; ``NO_ARGS`` where there are none or they are not an object."""
    try:
        return _decode_args(event.args)
    except msgspec.DecodeError:
        return NO_ARGS


def _message_bytes(args: Args) -> int | None:
    """Bytes a collective moves: In msg nelems x dtype size, else its input's dims x type size."""
    nelems, dtype = args.in_msg_nelems, args.dtype
    if isinstance(nelems, (int, float)) and isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        return int(nelems) * DTYPE_BYTES[dtype.lower()]
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
                count *= int(d)
            total += count * size
        return total or None
    return None


def _gpu_of(event: Event | OddEvent, args: Args) -> int | None:
    device = args.device
    if isinstance(device, (int, float)):
        return int(device)
    pid = event.pid
    return int(pid) if isinstance(pid, (int, float)) else None


def _name_kind(name: str) -> tuple[str, int] | None:
    """What a CPU range's name makes it: ("step", N), ("forward",), ... or None (an op dpprof does not need)."""
    if m := _STEP.match(name):
        return ("step", int(m.group(1)))
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
    if _BACKWARD.search(name):
        return ("backward", 0)
    return None


_GPU_CATS = _KERNEL_CATS | _MEMCPY_CATS | _MEMSET_CATS


def collect(trace: TraceFile) -> Collected:
    """Read the trace once and keep what dpprof's records need (see the module docstring)."""
    out = Collected(name=trace.name, size_bytes=trace.size_bytes, meta=trace.meta)
    gpu = out.gpu
    backward = out.backward
    kinds: dict[str, tuple[str, int] | None] = {}  # name -> _name_kind(name): names repeat, step after step
    gpu_kinds: dict[tuple[str, str], str | None] = {}  # (cat, name) -> gpu_kind(cat, name): kernels repeat too
    first_us, last_us = float("inf"), float("-inf")
    cpu_cats, gpu_cats = _CPU_CATS, _GPU_CATS
    number = (int, float)
    for batch in trace.batches():
        for event in batch:
            ph = event.ph
            if ph == "X":
                cat = event.cat
                if cat in cpu_cats:
                    ts, dur = event.ts, event.dur
                    if not isinstance(ts, number):
                        continue
                    end = ts + dur if isinstance(dur, number) else ts
                    if ts < first_us:
                        first_us = ts
                    if end > last_us:
                        last_us = end
                    name = event.name
                    if not isinstance(name, str):  # odd fields are data, not errors: such an event is not one we need
                        continue
                    kind = kinds.get(name, ())
                    if kind == ():
                        kind = kinds[name] = _name_kind(name)
                    if kind is None:
                        continue
                    what = kind[0]
                    if what == "backward":
                        backward.add(ts, end)
                    elif what == "step":
                        out.steps.append((kind[1], float(ts), float(end)))
                    elif what == "forward":
                        out.forwards.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "dpprof":
                        out.dpprof_ranges.append(Range(name[len("dpprof."):], float(ts), float(end), event.tid))
                    elif what == "optimizer":
                        out.optimizer.append(Range(name, float(ts), float(end), event.tid))
                    elif what == "data":
                        out.data.append(Range(name, float(ts), float(end), event.tid))
                    else:
                        out.collectives.append(Collective(name, float(ts), float(end),
                                                          _message_bytes(args_of(event))))
                elif cat in gpu_cats:
                    ts, dur = event.ts, event.dur
                    if not isinstance(ts, number):
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
                    key = (index, kind)
                    if key not in gpu:
                        gpu[key] = _Intervals()
                    gpu[key].add(ts, end)
                    if kind == "communication":
                        what = args.collective_name if isinstance(args.collective_name, str) else name
                        out.comm_kernels.append((index, float(ts), float(end), _message_bytes(args),
                                                 collective_name(what)))
            elif ph == "i" and event.name == "[memory]":
                _memory(out, event)
            elif ph == "M" and event.name == "process_labels":
                labels = args_of(event).labels
                if isinstance(labels, str) and labels.startswith("GPU") and isinstance(event.pid, number):
                    out.gpu_labels[int(event.pid)] = labels
    out.first_us, out.last_us = float(first_us), float(last_us)
    out.events = trace.events_read
    out.steps.sort(key=lambda s: s[1])
    out.forwards.sort(key=lambda r: r.start_us)
    out.dpprof_ranges.sort(key=lambda r: r.start_us)
    out.optimizer.sort(key=lambda r: r.start_us)
    out.data.sort(key=lambda r: r.start_us)
    out.collectives.sort(key=lambda c: c.start_us)
    out.comm_kernels.sort(key=lambda k: k[1])
    _pair_collectives(out)
    return out


def _memory(out: Collected, event: Event | OddEvent) -> None:
    args = args_of(event)
    if args.device_type != 1:  # 0: CPU memory; 1: CUDA
        return
    device = args.device_id
    ts = event.ts
    if not isinstance(device, (int, float)) or not isinstance(ts, (int, float)):
        return
    device = int(device)
    if device not in out.memory:
        out.memory[device] = (array("d"), array("d"), array("d"))
    times, allocated, reserved = out.memory[device]
    total = args.total_allocated
    if not isinstance(total, (int, float)):  # the 2021 format: only each allocation's Bytes: allocated is their sum
        nbytes = args.bytes
        if not isinstance(nbytes, (int, float)):
            return
        out.memory_cumulative.add(device)
        total = (allocated[-1] if allocated else 0.0) + nbytes
    times.append(float(ts))
    allocated.append(float(total))
    res = args.total_reserved
    reserved.append(float(res) if isinstance(res, (int, float)) else float("nan"))


def _pair_collectives(out: Collected) -> None:
    """Give each collective op the next communication kernel launched after it, in order (NCCL runs one
    kernel per collective on its own stream); the kernel's message size wins where the op has none."""
    kernels = out.comm_kernels
    k = 0
    for op in out.collectives:
        while k < len(kernels) and kernels[k][1] < op.start_us:
            k += 1
        if k >= len(kernels):
            break
        _, start, end, nbytes, _ = kernels[k]
        op.kernel_start_us, op.kernel_end_us = start, end
        if op.bytes is None:
            op.bytes = nbytes
        k += 1
