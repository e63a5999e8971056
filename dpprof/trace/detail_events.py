"""The per-event half of ``dpprof.trace.detail``: what ``collect``'s one streaming pass keeps of each operator,
launch, kernel, ``[memory]`` event and module frame, in typed arrays (a few bytes a field, never a dict per event),
names, shapes, threads and launch configurations interned once. ``DetailCollector.raw()`` is what travels back from
a worker process in ``Collected.detail``; ``dpprof.trace.detail.detail_tables`` makes the tables of it.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dpprof.trace.numbers import MAX_BYTES, MAX_GPU_INDEX, is_time, whole

__all__ = ["DetailCollector", "RawDetail", "merge_details", "OP_CATS", "LAUNCH_CATS", "NO_ID", "STEP_PREFIX"]

OP_CATS = frozenset({"cpu_op", "Operator"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime"})
STEP_PREFIX = "ProfilerStep#"  # the 2021 format's step ranges are "Operator" events: steps, not operators
NO_ID = -1
_MAX_ID = 2 ** 62  # External ids and correlations: int64 with room


def _id(value: Any) -> int:
    """An External id or correlation as an int, NO_ID where it is none (a bool, a string, a fraction, out of range)."""
    if type(value) is int and 0 <= value <= _MAX_ID:
        return value
    n = whole(value, 0, _MAX_ID)
    return NO_ID if n is None else n


def _number(value: Any) -> float:
    """A finite number as a float, NaN where it is none."""
    if type(value) is float or type(value) is int:
        return float(value) if math.isfinite(value) else math.nan
    return math.nan


def _dims(value: Any) -> tuple[int, ...] | None:
    """A grid or block ([x, y, z] of whole numbers), None where it is none."""
    if not isinstance(value, list) or not 1 <= len(value) <= 3:
        return None
    out = tuple(whole(v, 0, 2 ** 31) for v in value)
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


def _tid_key(tid: Any) -> Any:
    """A thread id as one key whatever its JSON type: the 2021 format writes an op's tid as "25738" and its memory
    events' as 25738."""
    if isinstance(tid, str) and tid.isdigit() and len(tid) < 19:
        return int(tid)
    return tid if isinstance(tid, (str, int, float)) or tid is None else str(tid)


class _Table:
    """Strings (or other keys) interned to ints: names repeat millions of times, each is kept once."""

    __slots__ = ("ids", "keys")

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.keys: list[Any] = []

    def __call__(self, key: Any) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.keys)
            self.keys.append(key)
        return i


class _Linked(msgspec.Struct, gc=False):
    """The args that link an operator, its launches and their kernels: External id (``external id`` in the 2021
    format) and correlation."""

    external_id: Any = msgspec.field(default=None, name="External id")
    external_id_2021: Any = msgspec.field(default=None, name="external id")
    correlation: Any = None


class OpArgs(_Linked, gc=False):
    """The args of an operator or launch that dpprof reads; the input shapes undecoded (their JSON is the key)."""

    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")


class KernelArgs(_Linked, gc=False):
    """The args of a kernel that dpprof reads."""

    grid: Any = None
    block: Any = None
    registers: Any = msgspec.field(default=None, name="registers per thread")
    shared_memory: Any = msgspec.field(default=None, name="shared memory")
    blocks_per_sm: Any = msgspec.field(default=None, name="blocks per SM")
    occupancy: Any = msgspec.field(default=None, name="est. achieved occupancy %")


class MemoryArgs(msgspec.Struct, gc=False):
    """The args of a ``[memory]`` event that dpprof reads."""

    addr: Any = msgspec.field(default=None, name="Addr")
    bytes: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")


class ModuleArgs(msgspec.Struct, gc=False):
    """The args of a ``python_function`` event that dpprof reads."""

    module_id: Any = msgspec.field(default=None, name="Python module id")


_NO_OP_ARGS = OpArgs()
_NO_KERNEL_ARGS = KernelArgs()
_decode_op = msgspec.json.Decoder(OpArgs).decode
_decode_kernel = msgspec.json.Decoder(KernelArgs).decode
_decode_memory = msgspec.json.Decoder(MemoryArgs).decode
_decode_module = msgspec.json.Decoder(ModuleArgs).decode
@dataclass
class RawDetail:
    """What ``DetailCollector`` kept of one file: typed arrays and interned tables, picklable and compact."""

    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, bytes]] = field(default_factory=list)  # (name id, Input Dims JSON): an op's shape key
    tids: list[Any] = field(default_factory=list)
    configs: list[tuple[Any, ...]] = field(default_factory=list)  # (grid, block, registers, shared memory)
    arrays: dict[str, array] = field(default_factory=dict)
    device_properties: dict[int, dict[str, Any]] = field(default_factory=dict)
    left_out: int = 0  # values that cannot be (numbers.py), left out
    left_out_first: str = ""


_ARRAYS = {  # name -> typecode: ops, launches, kernels, memory events, modules
    "op_ts": "d", "op_dur": "d", "op_tid": "i", "op_shape": "i", "op_ext": "q",  # op_shape: (name, shapes) id
    "rt_ts": "d", "rt_tid": "i", "rt_corr": "q", "rt_ext": "q",
    "k_ts": "d", "k_dur": "d", "k_gpu": "i", "k_name": "i", "k_corr": "q", "k_ext": "q", "k_cfg": "i",
    "k_stream": "i",
    "k_bpsm": "d", "k_occ": "d",
    "m_ts": "d", "m_tid": "i", "m_gpu": "i", "m_addr": "q", "m_bytes": "q", "m_alloc": "d", "m_res": "d",
    "py_ts": "d", "py_dur": "d", "py_tid": "i", "py_name": "i",
}


class DetailCollector:
    """Called by ``collect`` for each operator, launch, kernel, ``[memory]`` event and module frame it reads; its
    ``raw()`` travels in ``Collected.detail``. Each method is a few appends: no per-event objects are kept."""

    def __init__(self) -> None:
        self.names = _Table()
        self.shapes = _Table()
        self.tids = _Table()
        self.configs = _Table()
        self.a: dict[str, array[Any]] = {k: array(t) for k, t in _ARRAYS.items()}
        a = self.a
        self._op_ts, self._op_dur, self._op_tid = a["op_ts"].append, a["op_dur"].append, a["op_tid"].append
        self._op_shape, self._op_ext = a["op_shape"].append, a["op_ext"].append
        self._tid_ids, self._name_ids, self._shape_ids = self.tids.ids, self.names.ids, self.shapes.ids
        self._launch_names: dict[str, bool] = {}
        self._raw_configs: dict[Any, int] = {}
        self.left_out = 0
        self.left_out_first = ""

    def _bad(self, what: str) -> None:
        self.left_out += 1
        if self.left_out == 1:
            self.left_out_first = what

    def op(self, ts: float, dur: float | None, tid: Any, name: str, raw_args: Any) -> None:
        """A ``cpu_op`` whose times ``collect`` checked (a ``ProfilerStep#N`` is a step, not an operator); one
        without a duration (``dur`` None: missing, or not a number) is left out and counted. The hottest call of
        the import after decoding (every op): lookups inlined."""
        if dur is None:
            self._bad(f"operator {name[:60]}: dur is missing or not a number")
            return
        if name.startswith(STEP_PREFIX):
            return
        try:
            args = _decode_op(raw_args) if raw_args else _NO_OP_ARGS
        except (msgspec.DecodeError, RecursionError):
            args = _NO_OP_ARGS
        ext = args.external_id
        if type(ext) is not int or ext < 0:
            ext = _id(ext)
        key = tid if type(tid) is int else _tid_key(tid)
        t = self._tid_ids.get(key)
        if t is None:
            t = self.tids(key)
        n = self._name_ids.get(name)
        if n is None:
            n = self.names(name)
        pair = (n, bytes(args.input_dims))  # the op and its shapes: the second grouping, one id
        d = self._shape_ids.get(pair)
        if d is None:
            d = self.shapes(pair)
        self._op_ts(ts)
        self._op_dur(dur)
        self._op_tid(t)
        self._op_shape(d)
        self._op_ext(ext)

    def launch(self, ts: float, tid: Any, name: str, raw_args: Any) -> None:
        """A ``cuda_runtime`` / ``cuda_driver`` (``Runtime``) call that launches (``cudaLaunchKernel``,
        ``cuLaunchKernel``, ``cudaGraphLaunch``, ...): its correlation and its op's External id. The other calls
        (a third of a trace's events: cudaEventRecord, cudaStreamIsCapturing, ...) launch no kernel and are
        skipped unread."""
        launches = self._launch_names.get(name)
        if launches is None:
            launches = self._launch_names[name] = "aunch" in name
        if not launches:
            return
        try:
            args = _decode_op(raw_args) if raw_args else _NO_OP_ARGS
        except (msgspec.DecodeError, RecursionError):
            return
        corr = args.correlation
        if type(corr) is not int or corr < 0:
            corr = _id(corr)
            if corr == NO_ID:
                return
        ext = args.external_id if args.external_id is not None else args.external_id_2021
        if type(ext) is not int or ext < 0:
            ext = _id(ext)
        key = tid if type(tid) is int else _tid_key(tid)
        t = self._tid_ids.get(key)
        if t is None:
            t = self.tids(key)
        a = self.a
        a["rt_ts"].append(ts)
        a["rt_tid"].append(t)
        a["rt_corr"].append(corr)
        a["rt_ext"].append(ext)

    def kernel(self, ts: float, dur: float, gpu: int, name: str, raw_args: Any, stream: Any = None) -> None:
        """A kernel on ``gpu`` (on ``stream``: the event's tid) whose times ``collect`` checked."""
        try:
            args = _decode_kernel(raw_args) if raw_args else _NO_KERNEL_ARGS
        except (msgspec.DecodeError, RecursionError):
            args = _NO_KERNEL_ARGS
        a = self.a
        a["k_ts"].append(ts)
        a["k_dur"].append(dur)
        a["k_gpu"].append(gpu)
        a["k_stream"].append(self.tids(stream if type(stream) is int else _tid_key(stream)))
        n = self._name_ids.get(name)
        a["k_name"].append(n if n is not None else self.names(name))
        corr = args.correlation
        a["k_corr"].append(corr if type(corr) is int and corr >= 0 else _id(corr))
        ext = args.external_id if args.external_id is not None else args.external_id_2021
        a["k_ext"].append(ext if type(ext) is int and ext >= 0 else _id(ext))
        grid, block = args.grid, args.block
        raw_cfg: Any = (tuple(grid) if type(grid) is list else grid, tuple(block) if type(block) is list else block,
                   args.registers, args.shared_memory)
        try:
            c = self._raw_configs.get(raw_cfg)
        except TypeError:  # an object where a number goes: unhashable, checked below
            c, raw_cfg = None, None
        if c is None:  # checked once per launch configuration
            c = self.configs((_dims(args.grid), _dims(args.block), whole(args.registers, 0, 2 ** 31),
                              whole(args.shared_memory, 0, MAX_BYTES)))
            if raw_cfg is not None:
                self._raw_configs[raw_cfg] = c
        a["k_cfg"].append(c)
        bpsm, occ = args.blocks_per_sm, args.occupancy
        if type(bpsm) is not float or type(occ) is not float or not bpsm >= 0 or not occ >= 0:
            bpsm, occ = _number(bpsm), _number(occ)
            if (args.blocks_per_sm is not None and not bpsm >= 0) or (args.occupancy is not None and not occ >= 0):
                self._bad(f"kernel {name[:60]}: blocks per SM {args.blocks_per_sm!r} or occupancy "
                          f"{args.occupancy!r} is not a number from 0")
                bpsm = bpsm if bpsm >= 0 else math.nan
                occ = occ if occ >= 0 else math.nan
        a["k_bpsm"].append(bpsm)
        a["k_occ"].append(occ)

    def memory(self, ts: Any, tid: Any, raw_args: Any) -> None:
        """A ``[memory]`` instant event (CPU or GPU); one whose numbers cannot be is left out and counted."""
        try:
            args = _decode_memory(raw_args) if raw_args else None
        except (msgspec.DecodeError, RecursionError):
            args = None
        if args is None:
            return
        if not is_time(ts):
            self._bad(f"[memory] at ts {ts!r}: not a time")
            return
        nbytes = whole(args.bytes, -MAX_BYTES, MAX_BYTES)
        if nbytes is None:
            if args.bytes is not None:
                self._bad(f"[memory] at ts {ts}: Bytes {args.bytes!r} is not a number of bytes")
            return
        kind = args.device_type
        gpu = whole(args.device_id, 0, MAX_GPU_INDEX) if kind == 1 else -1
        if gpu is None:
            return
        total = args.total_allocated
        alloc = whole(total, 0, MAX_BYTES)
        if total is not None and alloc is None:
            self._bad(f"[memory] at ts {ts}: Total Allocated {total!r} is not a number of bytes")
            return
        res = whole(args.total_reserved, 0, MAX_BYTES)
        a = self.a
        a["m_ts"].append(float(ts))
        a["m_tid"].append(self.tids(tid if type(tid) is int else _tid_key(tid)))
        a["m_gpu"].append(gpu)
        addr = whole(args.addr, 0, 2 ** 63 - 1)
        a["m_addr"].append(NO_ID if addr is None else addr)
        a["m_bytes"].append(nbytes)
        a["m_alloc"].append(math.nan if alloc is None else float(alloc))
        a["m_res"].append(math.nan if res is None else float(res))

    def python(self, ts: float, dur: float, tid: Any, name: str, raw_args: Any) -> None:
        """A ``python_function`` event: kept where it is an ``nn.Module`` (it has a ``Python module id``)."""
        if not name.startswith("nn.Module: "):
            return
        try:
            args = _decode_module(raw_args) if raw_args else None
        except (msgspec.DecodeError, RecursionError):
            return
        if args is None or args.module_id is None:
            return
        a = self.a
        a["py_ts"].append(ts)
        a["py_dur"].append(dur)
        a["py_tid"].append(self.tids(tid if type(tid) is int else _tid_key(tid)))
        a["py_name"].append(self.names(name[len("nn.Module: "):]))

    def raw(self, meta: Mapping[str, Any]) -> RawDetail:
        """What was kept, with the trace's ``deviceProperties`` (for occupancy where Kineto wrote none)."""
        return RawDetail(names=self.names.keys, shapes=self.shapes.keys, tids=self.tids.keys,
                         configs=self.configs.keys, arrays=self.a, device_properties=_device_properties(meta),
                         left_out=self.left_out, left_out_first=self.left_out_first)


def _device_properties(meta: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    props: dict[int, dict[str, Any]] = {}
    listed = meta.get("deviceProperties")
    if isinstance(listed, list):
        for p in listed:
            if isinstance(p, dict) and (i := whole(p.get("id"), 0, MAX_GPU_INDEX)) is not None:
                props[i] = p
    return props


# Which arrays hold ids of which interned table: a later part's ids are renumbered into the first's tables.
_IDS_OF = {"names": ("k_name", "py_name"), "shapes": ("op_shape",), "tids": ("op_tid", "rt_tid", "k_stream", "m_tid",
                                                                           "py_tid"),
           "configs": ("k_cfg",)}


def merge_details(parts: list[RawDetail], meta: Mapping[str, Any]) -> RawDetail:
    """The ``RawDetail`` of one file read in parts (in file order), as one pass over the whole file makes it: the
    later parts' names, shapes, threads and launch configurations interned into one set of tables (each kept once,
    in the order first met), their arrays appended with their ids renumbered. The first part's arrays are extended
    in place (its ids stay as they are) and each later part's are dropped once added: never held twice."""
    import numpy as np  # here: a worker process that only reads traces does not import it

    names, shapes, tids, configs = _Table(), _Table(), _Table(), _Table()
    arrays: dict[str, array[Any]] = parts[0].arrays if parts else {}
    for column, typecode in _ARRAYS.items():
        arrays.setdefault(column, array(typecode))
    left_out, left_out_first = 0, ""
    for k, part in enumerate(parts):
        name_ids = [names(n) for n in part.names]
        new = {"names": name_ids,
               "shapes": [shapes((name_ids[n], dims)) for n, dims in part.shapes],
               "tids": [tids(t) for t in part.tids],
               "configs": [configs(c) for c in part.configs]}
        renumber = {column: ids for table, ids in new.items() for column in _IDS_OF[table]}
        left_out += part.left_out
        left_out_first = left_out_first or part.left_out_first
        if k == 0:  # the first part's ids are the tables' own, and its arrays are the whole's
            continue
        for column, values in part.arrays.items():
            ids = renumber.get(column)
            if ids is None or ids == list(range(len(ids))):  # nothing to renumber
                arrays[column] += values
            else:
                renumbered = np.asarray(ids, dtype=np.intc)[np.frombuffer(values, dtype=np.intc)]
                arrays[column].frombytes(renumbered.tobytes())
        part.arrays = {}  # added: not held twice
    return RawDetail(names=names.keys, shapes=shapes.keys, tids=tids.keys, configs=configs.keys, arrays=arrays,
                     device_properties=_device_properties(meta), left_out=left_out, left_out_first=left_out_first)
