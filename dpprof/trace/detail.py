"""Operators, kernels, GPU metrics, memory over time and modules of one torch.profiler trace, gathered during the
import's one streaming pass (``dpprof.trace.collect`` calls ``dpprof.trace.detail_events.DetailCollector`` for the
few categories it reads) and turned into tables once the file is read (``detail_tables``).

What is kept per event is a few numbers in typed arrays (``array``: 4-8 bytes a field, never a dict per event);
names, (name, input shapes) pairs, threads and kernel launch configurations are interned once: about 32 bytes an
operator, 24 a launch, 56 a kernel, 48 a memory event (bench/trace_import.py's 1 GiB trace: 2 M operators, peak
RSS of the whole import about 370 MiB).

Definitions (each figure is computed once, here; the pages and commands read the stored tables):

- **Operators** are ``cpu_op`` events (``Operator`` in the 2021 format), grouped by name, and by name and input
  shapes (``args["Input Dims"]``). Host total time is the op's duration; host self time is its duration minus its
  direct children's (ops nested in it on the same thread). An op's kernels are found through its launches: a
  kernel's ``correlation`` names a ``cuda_runtime`` / ``cuda_driver`` (``Runtime``) launch, whose ``External id``
  names the op; where that id names no op (a sampled trace), the innermost op open on the launch's thread when it
  was made; where a kernel has no launch, its own ``External id``. Device self time is the duration of the kernels
  an op launched itself; device total time adds its children's.
- **Tensor cores** (the TensorBoard plugin's rule, torch_tb_profiler/profiler/tensor_core.py, copied from NVIDIA
  PyProf's tc.py and torch's autocast lists): a kernel uses tensor cores if its name contains one of
  ``TC_KERNEL_PATTERNS``; an operator is eligible if its name is one of ``TC_ELIGIBLE_OPS``; ``tc_pct`` is the share
  of an op's device total time on tensor-core kernels.
- **Kernels** (``kernel`` / ``Kernel``): calls, total, mean, min, max; mean blocks per SM and mean estimated achieved
  occupancy weighted by duration, from Kineto's ``blocks per SM`` and ``est. achieved occupancy %``, else computed
  from ``grid``, ``block``, registers, shared memory and ``deviceProperties`` (``estimated_blocks_per_sm``,
  ``estimated_occupancy_pct``).
- **GPU metrics** per device and step (the TensorBoard plugin's definitions, tb_plugin/docs/gpu_utilization.md):
  *GPU utilization* = GPU busy time / step time, busy while at least one kernel runs; *Est. SM efficiency* =
  time-weighted SM_Eff_K / step time, SM_Eff_K = min(blocks of the kernel / SMs of the GPU, 100%) (blocks per SM),
  summed over kernels running at once and capped at 100%; *Est. achieved occupancy* = the kernels' OCC_K weighted
  by their duration within the step, OCC_K = min(threads of the kernel / SMs / max threads per SM, the kernel's
  theoretical occupancy) (Kineto's ``est. achieved occupancy %``). A summary row per device (``step`` None) takes
  all steps together, from the first step's start to the last step's end (the plugin's overview stretches the last
  step to its last kernel's end: bench/tb_plugin.py).
- **Memory over time** per device: ``Total Allocated`` / ``Total Reserved`` of the ``[memory]`` events, else the
  running sum of their ``Bytes`` (as dpprof's allocator curve: ``Collected.memory`` for GPUs), bucketed to at most
  ``MEMORY_POINTS`` points (each bucket's maximum: the peak is never lost), the peak and its step. **Memory events**
  pair an allocation with the next event at the same address (``Addr``) on the same device if that is a free (another
  allocation there first leaves its free unknown), in arrays, not event by event: the operator (innermost
  op open on the thread at the allocation), bytes, when, how long it lived (None: never freed in the trace). Every
  pair counts in the per-operator statistics; the ``MEMORY_EVENTS_KEPT`` largest are kept as rows, and the number
  left out is said in the notes.
- **Modules** (``python_function`` events with ``Python module id``, profiled with ``with_stack`` and
  ``with_modules``): the tree by nesting on a thread; per module path, occurrences, operators directly inside, host
  time (the module's duration) and device time (its operators' kernels, children included).

A value that cannot be (a NaN, a string where a number goes) is left out and counted (``Detail.left_out``), never
an error: the rules of ``dpprof.trace.numbers``.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from dpprof.trace.collect import collect
from dpprof.trace.decode import TraceFile
from dpprof.trace.detail_events import RawDetail
from dpprof.trace.numbers import MAX_BYTES, whole

__all__ = ["Detail", "detail_tables", "detail_of_trace", "TC_KERNEL_PATTERNS",
           "TC_ELIGIBLE_OPS", "uses_tensor_cores", "tc_eligible", "MEMORY_POINTS", "MEMORY_EVENTS_KEPT", "HOST_MEMORY",
           "OPERATOR_COLUMNS", "SHAPE_COLUMNS", "KERNEL_COLUMNS", "KERNEL_OP_COLUMNS", "GPU_METRIC_COLUMNS",
           "MEMORY_TIMELINE_COLUMNS", "MEMORY_PEAK_COLUMNS", "MEMORY_EVENT_COLUMNS", "OPERATOR_MEMORY_COLUMNS",
           "MODULE_COLUMNS", "STREAM_SPAN_COLUMNS", "STREAM_MERGE_SHARE", "estimated_blocks_per_sm",
           "estimated_occupancy_pct"]

# The TensorBoard plugin's lists (kineto tb_plugin torch_tb_profiler/profiler/tensor_core.py, TC_Allowlist and
# TC_OP_Allowlist): kernel-name patterns from NVIDIA PyProf (pyprof/prof/tc.py#L19), ops from torch's autocast
# lists (aten/src/ATen/autocast_mode.cpp) and the backward ops found to launch tensor-core kernels.
TC_KERNEL_PATTERNS = ("h884", "s884", "h1688", "s1688", "hmma", "i8816", "16816", "dgrad_1x1_stride_2x2",
                      "first_layer_wgrad_kernel", "conv1x1", "conv2d_c1_k1", "direct_group", "xmma_implicit_gemm",
                      "xmma_sparse_conv", "xmma_warp_specialized_implicit_gemm", "xmma_gemm", "xmma_sparse_gemm",
                      "c1688")
TC_ELIGIBLE_OPS = frozenset({
    "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_tbc",
    "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::convolution",
    "aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::prelu", "aten::addmm", "aten::addmv",
    "aten::addr", "aten::matmul", "aten::mm", "aten::mv", "aten::linear", "aten::addbmm", "aten::baddbmm",
    "aten::bmm", "aten::chain_matmul", "aten::linalg_multi_dot", "aten::_thnn_fused_lstm_cell",
    "aten::_thnn_fused_gru_cell", "aten::lstm_cell", "aten::gru_cell", "aten::rnn_tanh_cell", "aten::rnn_relu_cell",
    "CudnnConvolutionBackward", "BmmBackward0", "aten::cudnn_convolution_transpose_backward",
    "CudnnConvolutionTransposeBackward", "MmBackward", "aten::cudnn_convolution_backward_weight", "aten::addmm_",
    "AddmvBackward", "MvBackward", "aten::cudnn_convolution_transpose_backward_weight",
    "aten::cudnn_convolution_transpose_backward_input", "AddmmBackward", "aten::cudnn_convolution_backward_input",
    "AddbmmBackward", "aten::cudnn_convolution_backward"})
HOST_MEMORY = "host"  # the device of a GPU process's own (CPU) memory events
MEMORY_POINTS = 2_000  # points per device of the stored memory curve: what a chart draws (queries.MAX_POINTS)
# Memory events stored as rows: the largest allocations, enough for any table a person reads; every pair still
# counts in the per-operator statistics, and the notes say how many rows were left out.
MEMORY_EVENTS_KEPT = 100_000

OPERATOR_COLUMNS = ["device", "name", "calls", "host_total_ms", "host_self_ms", "device_total_ms", "device_self_ms",
                    "tc_eligible", "tc_pct"]
SHAPE_COLUMNS = ["device", "name", "input_shapes", "calls", "host_total_ms", "host_self_ms", "device_total_ms",
                 "device_self_ms", "tc_eligible", "tc_pct"]
KERNEL_COLUMNS = ["device", "name", "calls", "total_ms", "mean_ms", "min_ms", "max_ms", "mean_blocks_per_sm",
                  "mean_occupancy_pct", "tensor_cores"]
KERNEL_OP_COLUMNS = ["device", "name", "operator", "grid", "block", "registers_per_thread", "shared_memory_bytes",
                     "calls", "total_ms", "mean_ms", "min_ms", "max_ms", "mean_blocks_per_sm", "mean_occupancy_pct",
                     "tensor_cores"]
GPU_METRIC_COLUMNS = ["device", "step", "window_ms", "busy_ms", "utilization_pct", "sm_efficiency_pct",
                      "achieved_occupancy_pct"]
MEMORY_TIMELINE_COLUMNS = ["device", "t_ms", "allocated_bytes", "reserved_bytes"]
MEMORY_PEAK_COLUMNS = ["device", "peak_allocated_bytes", "peak_reserved_bytes", "peak_t_ms", "peak_step",
                       "readings", "cumulative"]
MEMORY_EVENT_COLUMNS = ["device", "operator", "bytes", "alloc_t_ms", "free_t_ms", "lifetime_ms"]
OPERATOR_MEMORY_COLUMNS = ["device", "name", "calls", "allocations", "allocated_bytes", "frees", "freed_bytes",
                           "size_increase_bytes"]
# The Timeline's GPU stream lanes: a stream's kernels in a step, those less than this share of the step apart drawn
# as one span (0.2%: two pixels of a 1,000-pixel step), so a step of thousands of kernels is a few hundred bars.
STREAM_MERGE_SHARE = 0.002
STREAM_SPAN_COLUMNS = ["device", "stream", "step", "start_ms", "duration_ms", "busy_ms", "kernels"]
MODULE_COLUMNS = ["device", "path", "module", "parent", "occurrences", "operators", "host_total_ms",
                  "device_total_ms"]


def uses_tensor_cores(kernel: str) -> bool:
    """Whether a kernel's name says it runs on tensor cores (the plugin's TC_Allowlist: a pattern in the name)."""
    return any(p in kernel for p in TC_KERNEL_PATTERNS)


def tc_eligible(op: str) -> bool:
    """Whether an operator can use tensor cores (the plugin's TC_OP_Allowlist: its name, exactly)."""
    return op in TC_ELIGIBLE_OPS


@dataclass
class Detail:
    """One trace file's operator, kernel, GPU-metric, memory and module tables (columns: the ``*_COLUMNS`` lists,
    times in ms, bytes in bytes, ``device`` a label such as ``cuda:0``), and what was left out, in ``notes``."""

    operators: pd.DataFrame
    operators_by_shape: pd.DataFrame
    kernels: pd.DataFrame
    kernels_by_op: pd.DataFrame
    gpu_metrics: pd.DataFrame
    memory_timeline: pd.DataFrame
    memory_peaks: pd.DataFrame
    memory_events: pd.DataFrame
    operator_memory: pd.DataFrame
    modules: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    stream_spans: pd.DataFrame = field(default_factory=lambda: _empty(STREAM_SPAN_COLUMNS))

    TABLES = ("operators", "operators_by_shape", "kernels", "kernels_by_op", "gpu_metrics", "memory_timeline",
              "memory_peaks", "memory_events", "operator_memory", "modules", "stream_spans")

    def frames(self) -> dict[str, pd.DataFrame]:
        return {t: getattr(self, t) for t in self.TABLES}


def _np(raw: RawDetail, name: str) -> np.ndarray:
    arr = raw.arrays[name]
    return np.frombuffer(arr, dtype={"d": np.float64, "i": np.int32, "q": np.int64}[arr.typecode]) if len(arr) \
        else np.zeros(0, dtype={"d": np.float64, "i": np.int32, "q": np.int64}[arr.typecode])


_Times = Callable[[], tuple[np.ndarray, np.ndarray]]  # ops' starts and ends in _nest's order, made on demand
_NEST_CHUNK = 1 << 16  # intervals walked per chunk: a chunk's Python numbers at a time, never every interval's


def _nest(tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, parent, depth): ``order`` sorts the intervals by thread, start, longest first (of two alike, the one
    earlier in the file first); ``parent[k]`` is the position in ``order`` of the innermost interval holding the
    k-th sorted one on its thread (it begins no later, ends no later, and the k-th begins before it ends), -1 for
    none; ``depth[k]`` the number of intervals holding it. A thread whose intervals nest properly (two are nested
    or apart) is done in numpy (``_nest_nested``); one with an overlap that is not a nesting, by a stack."""
    order = _sort_order(tid, ts, dur)
    n = len(order)
    parent = np.full(n, -1, dtype=np.int32)
    depth = np.zeros(n, dtype=np.int32)
    t = tid[order]
    bounds = (np.flatnonzero(np.diff(t)) + 1).tolist()
    del t
    for lo, hi in zip([0, *bounds], [*bounds, n]):
        part = order[lo:hi]
        s, d = ts[part], dur[part]
        if not _nest_nested(s, d, parent, depth, lo):
            _nest_stack(s, d, parent, depth, lo)
    return order, parent, depth


def _nest_nested(s: np.ndarray, d: np.ndarray, parent: np.ndarray, depth: np.ndarray, lo: int) -> bool:
    """One thread's intervals (sorted) nested in numpy, where they nest properly: an interval's depth is the number
    of intervals of some length before it still open at its start, its parent the nearest one before it of one
    depth less; False (nothing written) where some interval is not inside the parent so found: an overlap that is
    not a nesting, for the stack."""
    m = len(s)
    e = s + d
    long_ = d > 0  # an interval of no length holds nothing
    before: np.ndarray = np.cumsum(long_) - long_
    dep = before - np.searchsorted(np.sort(e[long_]), s, "right")
    if m == 0 or (dep < 0).any():
        return m == 0
    par = np.full(m, -1, dtype=np.int64)
    by_depth = np.argsort(dep, kind="stable")  # each depth's positions, in order
    levels = dep[by_depth]
    cuts = np.flatnonzero(np.diff(levels)) + 1
    groups = np.split(by_depth, cuts)
    level_of = levels[np.concatenate(([0], cuts))] if len(by_depth) else np.zeros(0, dtype=levels.dtype)
    holders: dict[int, np.ndarray] = {}
    for level, at in zip(level_of.tolist(), groups):
        holders[level] = at[long_[at]]
        if level == 0:
            continue
        cands = holders.get(level - 1)
        if cands is None or not len(cands):
            return False
        idx = np.searchsorted(cands, at) - 1
        if (idx < 0).any():
            return False
        par[at] = cands[idx]
    has = par >= 0
    p = par[has]
    if not ((e[has] <= e[p]) & (s[has] < e[p])).all():
        return False
    parent[lo:lo + m] = np.where(has, par + lo, -1)
    depth[lo:lo + m] = dep
    return True


def _nest_stack(s: np.ndarray, d: np.ndarray, parent: np.ndarray, depth: np.ndarray, lo: int) -> None:
    """One thread's intervals (sorted) nested by a stack, a chunk of Python numbers at a time: an interval that
    ended before this one starts, or overlaps it without holding it, is no holder of it or of what follows."""
    stack: list[int] = []
    ends: list[float] = []  # the stack's ends
    m = len(s)
    for c in range(0, m, _NEST_CHUNK):
        s_part, e_part = s[c:c + _NEST_CHUNK].tolist(), (s[c:c + _NEST_CHUNK] + d[c:c + _NEST_CHUNK]).tolist()
        p_part = [-1] * len(s_part)
        d_part = [0] * len(s_part)
        for i, (start, stop) in enumerate(zip(s_part, e_part)):
            while ends and (ends[-1] <= start or ends[-1] < stop):
                stack.pop()
                ends.pop()
            if stack:
                p_part[i] = stack[-1]
                d_part[i] = len(stack)  # the stack is the chain of intervals holding this one
            stack.append(lo + c + i)
            ends.append(stop)
        parent[lo + c:lo + c + len(s_part)] = p_part
        depth[lo + c:lo + c + len(s_part)] = d_part


def _sort_order(tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Positions sorting intervals by thread, start, longest first, as int32. Kineto writes most threads' ops in
    that order already: a stable sort by thread (linear on small ints) and a check then do; else a full sort."""
    by_tid = np.argsort(tid, kind="stable").astype(np.int32)
    if len(by_tid) < 2:
        return by_tid
    t, s = tid[by_tid], ts[by_tid]
    same = t[1:] == t[:-1]
    ds = s[1:] - s[:-1]
    del s
    d = dur[by_tid]
    ordered = ~same | (ds > 0) | ((ds == 0) & (d[1:] <= d[:-1]))
    del t, ds, d, same
    if ordered.all():
        return by_tid
    del by_tid, ordered
    return np.lexsort((-dur, ts, tid)).astype(np.int32)


def _up(values: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Each interval's value plus all its descendants' (children first: the deepest level is added to its
    parents, then the next), vectorized per level."""
    total = values.astype(float, copy=True)
    if not len(total) or not total.any():
        return total
    for level in range(int(depth.max()), 0, -1):  # one pass a level: a mask, never a sort of every interval
        at = np.flatnonzero(depth == level)
        np.add.at(total, parent[at], total[at])
    return total


def _innermost(s_tid: np.ndarray, s_ts: np.ndarray, s_end: np.ndarray, parent: np.ndarray,
               q_tid: np.ndarray, q_ts: np.ndarray) -> np.ndarray:
    """For each query (thread, time): the position of the innermost interval on that thread open at that time, -1
    for none; the intervals' threads, starts and ends in ``_nest``'s order, with its ``parent``."""
    if not len(s_ts) or not len(q_ts):
        return np.full(len(q_ts), -1, dtype=np.int64)
    out = np.full(len(q_ts), -1, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(s_tid)) + 1
    starts = np.concatenate(([0], bounds))
    stops = np.concatenate((bounds, [len(s_tid)]))
    par, ends = array("q"), array("d")  # 8 bytes an interval, read one number at a time
    par.frombytes(parent.astype(np.int64).tobytes())
    ends.frombytes(s_end.astype(np.float64).tobytes())
    for lo, hi in zip(starts.tolist(), stops.tolist()):
        mine = np.flatnonzero(q_tid == s_tid[lo])
        if not len(mine):
            continue
        cand = np.searchsorted(s_ts[lo:hi], q_ts[mine], "right") - 1 + lo
        for j, c in zip(mine.tolist(), cand.tolist()):
            t = float(q_ts[j])
            while c >= lo and ends[c] < t:
                c = par[c]
            out[j] = c if c >= lo else -1
    return out


def estimated_blocks_per_sm(grid: tuple[int, ...] | None, props: Mapping[str, Any] | None) -> float:
    """Blocks of a kernel per SM: grid blocks / the GPU's SMs (``numSms``); NaN where either is unknown."""
    sms = whole((props or {}).get("numSms"), 1, 2 ** 20)
    if grid is None or sms is None:
        return math.nan
    return float(np.prod(grid)) / sms


def estimated_occupancy_pct(grid: tuple[int, ...] | None, block: tuple[int, ...] | None, registers: int | None,
                            shared_bytes: int | None, props: Mapping[str, Any] | None) -> float:
    """The plugin's OCC_K where Kineto wrote none: min(threads / SMs / max threads per SM, theoretical occupancy),
    the theoretical one from the blocks an SM can hold as limited by its warps, registers and shared memory
    (CUDA's occupancy calculator without allocation granularity); NaN where a number is unknown."""
    p = props or {}
    sms = whole(p.get("numSms"), 1, 2 ** 20)
    max_threads = whole(p.get("maxThreadsPerMultiprocessor"), 1, 2 ** 20)
    warp = whole(p.get("warpSize"), 1, 1024) or 32
    if grid is None or block is None or sms is None or max_threads is None:
        return math.nan
    threads_per_block = int(np.prod(block))
    if threads_per_block <= 0:
        return math.nan
    warps_per_block = math.ceil(threads_per_block / warp)
    max_warps = max_threads // warp
    limits = [max_warps // warps_per_block]
    regs_sm = whole(p.get("regsPerMultiprocessor"), 1, 2 ** 30)
    if registers and regs_sm:
        limits.append(regs_sm // (registers * warps_per_block * warp))
    smem_sm = whole(p.get("sharedMemPerMultiprocessor"), 1, 2 ** 40)
    if shared_bytes and smem_sm:
        limits.append(smem_sm // shared_bytes)
    theoretical = max(min(limits), 0) * warps_per_block / max_warps
    achieved = float(np.prod(grid)) * threads_per_block / sms / max_threads
    return 100.0 * min(achieved, theoretical)


def _label_fn(label_of: Mapping[int, str], host: str) -> Any:
    return lambda gpu: label_of.get(gpu, f"cuda:{gpu}") if gpu >= 0 else host


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: [] for c in columns})


def detail_tables(raw: RawDetail, windows: list[tuple[int, float, float]], t0_us: float,
                  label_of: Mapping[int, str], host: str,
                  device_of_thread: Mapping[Any, str] | None = None,
                  gpu_memory: Mapping[int, tuple[array, array, array]] | None = None,
                  cumulative_gpus: set[int] | None = None) -> Detail:
    """The tables of one file, from what ``DetailCollector`` kept.

    Args:
        raw: ``Collected.detail``.
        windows: (step, start_us, end_us) of each step, in the trace's µs (``convert``'s step windows).
        t0_us: the run's time origin in the trace's µs: ``t_ms`` columns count from it.
        label_of: GPU index -> device label (``cuda:0``, or ``rank:N`` in a distributed run).
        host: the device of host work not tied to a GPU (``process_label``).
        device_of_thread: trace tid -> device label: each thread's ops (and CPU memory) go to its device
            (dpprof's CPU worker threads); else an op's device is the GPU its thread launched most kernels to.
        gpu_memory: ``Collected.memory`` (GPU index -> ts, allocated, reserved): the allocator curve dpprof draws,
            read as it is.
        cumulative_gpus: ``Collected.memory_cumulative``: GPUs whose allocated bytes are a running sum of Bytes.
    """
    label = _label_fn(label_of, host)
    notes: list[str] = []
    if raw.left_out:
        notes.append(f"{raw.left_out:,} value{'s' if raw.left_out > 1 else ''} that cannot be (a time or size no "
                     f"event can have) left out of the operator, kernel and memory tables: the first, "
                     f"{raw.left_out_first}")
    names = np.array(raw.names, dtype=object) if raw.names else np.zeros(0, dtype=object)
    # Operators. Memory: a 1 GiB trace holds ~2 M ops, so every array here costs ~16 MB for each 8 bytes an op;
    # each is made when needed and dropped after (peak RSS under 400 MB: bench/trace_import.py).
    op_ts, op_dur, op_tid = _np(raw, "op_ts"), _np(raw, "op_dur"), _np(raw, "op_tid")
    order, parent_sorted, depth = _nest(op_tid, op_ts, op_dur)
    n_ops = len(order)
    # in _nest's order from here; what was read goes as soon as it is copied (the starts stay for _starts_ends)
    dur, s_tid = op_dur[order], op_tid[order]
    del op_dur, op_tid
    for name in ("op_dur", "op_tid"):
        raw.arrays[name] = array(raw.arrays[name].typecode)

    def starts_ends() -> tuple[np.ndarray, np.ndarray]:
        """Each op's start and end in _nest's order, made only where a time must be placed in an op."""
        s_ts = op_ts[order]
        return s_ts, s_ts + dur
    # every per-op sum is added up per (thread, name and shapes) as soon as it is made, and the op array dropped:
    # one bin a pair (ids interned by the collector), folded into devices once each thread's device is known
    pair_name = np.array([p[0] for p in raw.shapes], dtype=np.int32) if raw.shapes else np.zeros(0, np.int32)
    s_pair = _np(raw, "op_shape")[order]
    width = max(len(raw.shapes), 1)
    bins = max(len(raw.tids), 1) * width
    key = s_tid.astype(np.int32 if bins < 2 ** 31 else np.int64) * width + s_pair
    acc: dict[str, np.ndarray] = {"calls": np.bincount(key, minlength=bins),
                                  "host_total_ms": np.bincount(key, weights=dur, minlength=bins)}
    has_parent = parent_sorted >= 0
    children = np.bincount(parent_sorted[has_parent], weights=dur[has_parent], minlength=n_ops)
    del has_parent
    acc["host_self_ms"] = acc["host_total_ms"] - np.bincount(key, weights=children, minlength=bins)
    del children

    # kernels -> launches -> ops (positions in ``order``)
    k_ts, k_dur, k_gpu = _np(raw, "k_ts"), _np(raw, "k_dur"), _np(raw, "k_gpu")
    k_end = k_ts + k_dur
    k_name, k_corr, k_ext, k_cfg = _np(raw, "k_name"), _np(raw, "k_corr"), _np(raw, "k_ext"), _np(raw, "k_cfg")
    k_op = np.full(len(k_ts), -1, dtype=np.int64)
    if len(k_ts) and n_ops:
        rank_of = np.empty(n_ops, dtype=np.int32)  # original index -> position in order
        rank_of[order] = np.arange(n_ops, dtype=np.int32)
        op_ext = _np(raw, "op_ext")
        ext_order = np.argsort(op_ext, kind="stable").astype(np.int32)
        ext_sorted = op_ext[ext_order]

        def op_of_ext(ext: np.ndarray) -> np.ndarray:
            """The position in ``order`` of the op with each External id, -1 for none."""
            pos = np.minimum(np.searchsorted(ext_sorted, ext), n_ops - 1)
            found = (ext_sorted[pos] == ext) & (ext >= 0)
            return np.where(found, rank_of[ext_order[pos]], -1)

        rt_corr, rt_ext, rt_ts, rt_tid = (_np(raw, "rt_corr"), _np(raw, "rt_ext"), _np(raw, "rt_ts"),
                                          _np(raw, "rt_tid"))
        # each launch's op: its External id, else the innermost op open on its thread when it was made
        rt_op = op_of_ext(rt_ext)
        lost = rt_op < 0
        if lost.any():
            rt_op[lost] = _innermost(s_tid, *starts_ends(), parent_sorted, rt_tid[lost], rt_ts[lost])
        if len(rt_corr):
            corr_order = np.argsort(rt_corr, kind="stable")
            corr_sorted = rt_corr[corr_order]
            pos = np.minimum(np.searchsorted(corr_sorted, k_corr), len(corr_sorted) - 1)
            hit = (corr_sorted[pos] == k_corr) & (k_corr >= 0)
            k_op[hit] = rt_op[corr_order[pos[hit]]]
        no_launch = k_op < 0  # no launch with its correlation, or one of no op: its own External id's op
        if no_launch.any():
            k_op[no_launch] = op_of_ext(k_ext[no_launch])
        del rank_of, ext_order, ext_sorted
    unlinked = int((k_op < 0).sum())
    if unlinked and n_ops:
        notes.append(f"{unlinked:,} of {len(k_ts):,} kernels linked to no operator (no launch with their "
                     "correlation, no op with their External id): they count in the kernel tables only")
    tc_kernel = np.array([uses_tensor_cores(n) for n in raw.names], dtype=bool) if raw.names else np.zeros(0, bool)
    k_tc = tc_kernel[k_name] if len(k_name) else np.zeros(0, dtype=bool)
    linked = k_op >= 0
    dev_self = np.bincount(k_op[linked], weights=k_dur[linked], minlength=n_ops)
    acc["device_self_ms"] = np.bincount(key, weights=dev_self, minlength=bins)
    acc["device_total_ms"] = np.bincount(key, weights=_up(dev_self, parent_sorted, depth), minlength=bins)
    tc_on = linked & k_tc
    acc["tc_ms"] = (np.bincount(key, weights=_up(np.bincount(k_op[tc_on], weights=k_dur[tc_on], minlength=n_ops),
                                                 parent_sorted, depth), minlength=bins)
                    if tc_on.any() else np.zeros(bins))
    del tc_on, key

    # each thread's device
    tid_device: dict[int, str] = {}
    if device_of_thread:
        for i, t in enumerate(raw.tids):
            for key in (t, str(t)):
                if key in device_of_thread:
                    tid_device[i] = device_of_thread[key]
                    break
            else:
                if isinstance(t, str) and t.isdigit() and int(t) in device_of_thread:
                    tid_device[i] = device_of_thread[int(t)]
    explicit = dict(tid_device)  # the threads device_of_thread names: their CPU memory is their device's
    if linked.any():  # a thread's GPU: the one it launched most kernels to
        pair, count = np.unique((s_tid[k_op[linked]].astype(np.int64) << 32) | k_gpu[linked], return_counts=True)
        best: dict[int, tuple[int, int]] = {}
        for key, n in zip(pair.tolist(), count.tolist()):
            t, gpu = key >> 32, key & 0xFFFFFFFF
            if t not in best or n > best[t][0]:
                best[t] = (n, gpu)
        for t, (_, gpu) in best.items():
            tid_device.setdefault(t, label(gpu))
    gpus_present = len(k_ts) > 0
    used = np.flatnonzero(acc["calls"])
    per_pair = pd.DataFrame({"device": [tid_device.get(int(b) // width, host) for b in used],
                             "pair": used % width, **{c: v[used] for c, v in acc.items()}})
    acc.clear()
    per_pair["name"] = [raw.names[raw.shapes[int(p)][0]] for p in per_pair["pair"]]
    per_pair["input_shapes"] = [_shape_text(raw.shapes[int(p)][1]) for p in per_pair["pair"]]
    sums = ["calls", "host_total_ms", "host_self_ms", "device_total_ms", "device_self_ms", "tc_ms"]

    def by(keys: list[str]) -> pd.DataFrame:
        """The (thread, name and shapes) sums folded by ``keys``."""
        out = per_pair.groupby(keys, sort=False)[sums].sum().reset_index()
        out["calls"] = out["calls"].astype(np.int64)
        for column in sums[1:]:
            out[column] = out[column] / 1e3
        out["tc_eligible"] = out["name"].map(tc_eligible).astype(bool)
        total = out["device_total_ms"]
        out["tc_pct"] = np.where(total > 0, 100.0 * out["tc_ms"] / total.where(total > 0), np.nan)
        if not gpus_present:  # a CPU-only trace: no device time at all, not zero
            out["device_total_ms"] = np.nan
            out["device_self_ms"] = np.nan
            out["tc_pct"] = np.nan
        return out.drop(columns="tc_ms").sort_values("host_total_ms", ascending=False, kind="stable")

    operators = by(["device", "name"])[OPERATOR_COLUMNS] if n_ops else _empty(OPERATOR_COLUMNS)
    operators_by_shape = by(["device", "name", "input_shapes"])[SHAPE_COLUMNS] if n_ops else _empty(SHAPE_COLUMNS)
    s_name = pair_name[s_pair] if n_ops else np.zeros(0, dtype=np.int32)  # each op's name id
    del s_pair

    kernels, kernels_by_op = _kernel_tables(raw, names, k_ts, k_dur, k_gpu, k_name, k_cfg, k_tc, k_op,
                                            s_name, label)
    gpu_metrics = _gpu_metrics(raw, k_ts, k_end, k_gpu, k_cfg, windows, label)
    stream_spans = _stream_spans(raw, k_ts, k_end, k_dur, k_gpu, _np(raw, "k_stream"), windows, t0_us, label)
    timeline, peaks, mem_events, op_memory, mem_notes = _memory_tables(
        raw, names, windows, t0_us, label, host, explicit, s_tid, starts_ends, parent_sorted, s_name,
        operators, gpu_memory or {}, cumulative_gpus or set(), bool(label_of) or len(k_ts) > 0)
    notes += mem_notes
    modules = _modules(raw, names, s_tid, starts_ends, dev_self, tid_device, host)
    return Detail(operators=operators.reset_index(drop=True), operators_by_shape=operators_by_shape.reset_index(drop=True),
                  kernels=kernels, kernels_by_op=kernels_by_op, gpu_metrics=gpu_metrics, memory_timeline=timeline,
                  memory_peaks=peaks, memory_events=mem_events, operator_memory=op_memory, modules=modules,
                  notes=notes, stream_spans=stream_spans)


def _shape_text(raw: bytes) -> str:
    """Input Dims as text without spaces ("[[32, 64], []]" -> "[[32,64],[]]"); "" where the op has none."""
    if not raw:
        return ""
    try:
        return msgspec.json.encode(msgspec.json.decode(raw)).decode()
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return ""


def _kernel_tables(raw: RawDetail, names: np.ndarray, k_ts: np.ndarray, k_dur: np.ndarray, k_gpu: np.ndarray,
                   k_name: np.ndarray, k_cfg: np.ndarray, k_tc: np.ndarray, k_op: np.ndarray, s_name: np.ndarray,
                   label: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    if not len(k_ts):
        return _empty(KERNEL_COLUMNS), _empty(KERNEL_OP_COLUMNS)
    bpsm, occ = _kernel_estimates(raw, k_gpu, k_cfg)
    ms = k_dur / 1e3
    # integer keys only (a kernel's name is often hundreds of characters: a frame of them per kernel is not kept)
    df = pd.DataFrame({"gpu": k_gpu, "name_id": k_name, "dur": ms, "cfg": k_cfg,
                       "bpsm_w": np.where(np.isnan(bpsm), 0.0, bpsm * ms), "bpsm_d": np.where(np.isnan(bpsm), 0.0, ms),
                       "occ_w": np.where(np.isnan(occ), 0.0, occ * ms), "occ_d": np.where(np.isnan(occ), 0.0, ms),
                       "tensor_cores": k_tc,
                       "op_id": np.where(k_op >= 0, s_name[np.maximum(k_op, 0)] if len(s_name) else -1, -1)})

    def agg(keys: list[str]) -> pd.DataFrame:
        g = df.groupby(keys, sort=False)
        out = g.agg(calls=("dur", "size"), total_ms=("dur", "sum"), min_ms=("dur", "min"), max_ms=("dur", "max"),
                    bw=("bpsm_w", "sum"), bd=("bpsm_d", "sum"), ow=("occ_w", "sum"), od=("occ_d", "sum"),
                    tensor_cores=("tensor_cores", "first")).reset_index()
        out["mean_ms"] = out["total_ms"] / out["calls"]
        out["mean_blocks_per_sm"] = out["bw"] / out["bd"].where(out["bd"] > 0)
        out["mean_occupancy_pct"] = out["ow"] / out["od"].where(out["od"] > 0)
        out["device"] = [label(int(g)) for g in out["gpu"]]
        out["name"] = [raw.names[i] for i in out["name_id"]]
        if "op_id" in out:
            out["operator"] = [raw.names[i] if i >= 0 else None for i in out["op_id"]]
        return out.sort_values("total_ms", ascending=False, kind="stable").reset_index(drop=True)

    kernels = agg(["gpu", "name_id"])[KERNEL_COLUMNS]
    by_op = agg(["gpu", "name_id", "op_id", "cfg"])
    cfgs = raw.configs
    by_op["grid"] = [_dims_text(cfgs[c][0]) for c in by_op["cfg"]]
    by_op["block"] = [_dims_text(cfgs[c][1]) for c in by_op["cfg"]]
    by_op["registers_per_thread"] = pd.array([cfgs[c][2] for c in by_op["cfg"]], dtype="Int64")
    by_op["shared_memory_bytes"] = pd.array([cfgs[c][3] for c in by_op["cfg"]], dtype="Int64")
    return kernels, by_op[KERNEL_OP_COLUMNS]


def _dims_text(d: tuple[int, ...] | None) -> str | None:
    return None if d is None else "[" + ", ".join(map(str, d)) + "]"


def _kernel_estimates(raw: RawDetail, k_gpu: np.ndarray, k_cfg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks per SM and occupancy % of each kernel: Kineto's, else estimated from its launch and the GPU."""
    bpsm, occ = _np(raw, "k_bpsm").copy(), _np(raw, "k_occ").copy()
    missing = np.flatnonzero(np.isnan(bpsm) | np.isnan(occ))
    if len(missing) and raw.device_properties:
        cache: dict[tuple[int, int], tuple[float, float]] = {}
        for i in missing.tolist():
            key = (int(k_gpu[i]), int(k_cfg[i]))
            if key not in cache:
                grid, block, regs, smem = raw.configs[key[1]]
                props = raw.device_properties.get(key[0])
                cache[key] = (estimated_blocks_per_sm(grid, props),
                              estimated_occupancy_pct(grid, block, regs, smem, props))
            b, o = cache[key]
            if math.isnan(bpsm[i]):
                bpsm[i] = b
            if math.isnan(occ[i]):
                occ[i] = o
    return bpsm, occ


def _union_within(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    """Length of the union of intervals (sorted, merged) within [lo, hi]: those ending after lo and starting
    before hi, found by two bisections."""
    first, last = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(starts, hi, "left"))
    starts, ends = starts[first:last], ends[first:last]
    s = np.clip(starts, lo, hi)
    e = np.clip(ends, lo, hi)
    return float((e - s).sum())


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals as sorted disjoint intervals."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    out_s = s[new]
    out_e = np.zeros(len(out_s))
    np.maximum.at(out_e, group, reach)
    return out_s, out_e


def _level_integral(starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step function sum(values of intervals open at t), capped at 1: (breakpoints, level after each)."""
    t = np.concatenate((starts, ends))
    d = np.concatenate((values, -values))
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    level = np.minimum(np.maximum(np.cumsum(d), 0.0), 1.0)
    return t, level


def _integrate(t: np.ndarray, level: np.ndarray, lo: float, hi: float) -> float:
    """The integral over [lo, hi] of the step function (breakpoints t, level[k] on [t[k], t[k+1]))."""
    if len(t) < 2:
        return 0.0
    first = max(int(np.searchsorted(t, lo, "right")) - 1, 0)  # the breakpoints around the window only
    last = min(int(np.searchsorted(t, hi, "left")) + 1, len(t))
    t, level = t[first:last], level[first:last]
    a = np.clip(t[:-1], lo, hi)
    b = np.clip(t[1:], lo, hi)
    return float(((b - a) * level[:-1]).sum())


def _stream_spans(raw: RawDetail, k_ts: np.ndarray, k_end: np.ndarray, k_dur: np.ndarray, k_gpu: np.ndarray,
                  k_stream: np.ndarray, windows: list[tuple[int, float, float]], t0_us: float,
                  label: Any) -> pd.DataFrame:
    """Each GPU stream's kernels in each step, those under STREAM_MERGE_SHARE of the step apart as one span: the
    span's start and length (ms from ``t0_us``), its kernels' summed time (``busy_ms``) and count. A kernel belongs
    to the step its start falls in; kernels outside every step are left out."""
    if not len(k_ts) or not windows or len(k_stream) != len(k_ts):
        return _empty(STREAM_SPAN_COLUMNS)
    win = sorted(windows, key=lambda w: w[1])
    lo = np.array([w[1] for w in win])
    hi = np.array([w[2] for w in win])
    pos = np.searchsorted(lo, k_ts, "right") - 1
    inside = (pos >= 0) & (k_ts < hi[np.maximum(pos, 0)])
    if not inside.any():
        return _empty(STREAM_SPAN_COLUMNS)
    ts, end, dur = k_ts[inside], k_end[inside], k_dur[inside]
    gpu, stream, w = k_gpu[inside], k_stream[inside], pos[inside]
    order = np.lexsort((ts, w, stream, gpu))
    ts, end, dur, gpu, stream, w = ts[order], end[order], dur[order], gpu[order], stream[order], w[order]
    gap = (hi - lo)[w] * STREAM_MERGE_SHARE
    reach = end.copy()  # within a group, the furthest end so far
    group = np.concatenate(([True], (gpu[1:] != gpu[:-1]) | (stream[1:] != stream[:-1]) | (w[1:] != w[:-1])))
    if group.any():
        starts = np.flatnonzero(group)
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), len(end)]):
            reach[a:b] = np.maximum.accumulate(end[a:b])
    new = group.copy()
    new[1:] |= ts[1:] - reach[:-1] > gap[1:]
    span = np.cumsum(new) - 1
    df = pd.DataFrame({"span": span, "gpu": gpu, "stream": stream, "w": w, "ts": ts, "end": end, "dur": dur})
    g = df.groupby("span", sort=True).agg(gpu=("gpu", "first"), stream=("stream", "first"), w=("w", "first"),
                                          ts=("ts", "min"), end=("end", "max"), busy=("dur", "sum"),
                                          kernels=("dur", "size"))
    steps = np.array([w_[0] for w_ in win])
    tids = raw.tids
    return pd.DataFrame({"device": [label(int(x)) for x in g["gpu"]],
                         "stream": [str(tids[int(x)]).removeprefix("stream ") for x in g["stream"]],  # 2021's tid
                         "step": steps[g["w"].to_numpy()].astype(np.int64),
                         "start_ms": (g["ts"].to_numpy() - t0_us) / 1e3,
                         "duration_ms": (g["end"].to_numpy() - g["ts"].to_numpy()) / 1e3,
                         "busy_ms": g["busy"].to_numpy() / 1e3, "kernels": g["kernels"].to_numpy()},
                        columns=STREAM_SPAN_COLUMNS)


def _gpu_metrics(raw: RawDetail, k_ts: np.ndarray, k_end: np.ndarray, k_gpu: np.ndarray, k_cfg: np.ndarray,
                 windows: list[tuple[int, float, float]], label: Any) -> pd.DataFrame:
    if not len(k_ts) or not windows:
        return _empty(GPU_METRIC_COLUMNS)
    bpsm, occ = _kernel_estimates(raw, k_gpu, k_cfg)
    rows = []
    spans = [*windows, (None, min(w[1] for w in windows), max(w[2] for w in windows))]
    for gpu in sorted(set(k_gpu.tolist())):
        mine = k_gpu == gpu
        s, e = k_ts[mine], k_end[mine]
        ms, me = _merge(s, e)
        b, o = bpsm[mine], occ[mine]
        has_b = ~np.isnan(b) & (b > 0)
        t, level = _level_integral(s[has_b], e[has_b], b[has_b])
        has_o = ~np.isnan(o)
        by_start = np.argsort(s[has_o], kind="stable")
        os_, oe, ov = s[has_o][by_start], e[has_o][by_start], o[has_o][by_start]
        longest = float((oe - os_).max()) if len(os_) else 0.0
        for step, lo, hi in spans:
            window = hi - lo
            if window <= 0:
                continue
            busy = _union_within(ms, me, lo, hi)
            # the kernels that can reach into the window: started before its end, and after its start less the
            # longest kernel
            near = slice(int(np.searchsorted(os_, lo - longest, "left")), int(np.searchsorted(os_, hi, "right")))
            clipped = np.clip(oe[near], lo, hi) - np.clip(os_[near], lo, hi)
            weight = clipped.sum()
            rows.append({"device": label(int(gpu)), "step": step, "window_ms": window / 1e3, "busy_ms": busy / 1e3,
                         "utilization_pct": 100.0 * busy / window,
                         "sm_efficiency_pct": 100.0 * _integrate(t, level, lo, hi) / window if has_b.any() else math.nan,
                         "achieved_occupancy_pct": float((clipped * ov[near]).sum() / weight) if weight > 0
                         else math.nan})
    out = pd.DataFrame(rows, columns=GPU_METRIC_COLUMNS)
    out["step"] = out["step"].astype("Int64")
    return out


def _memory_tables(raw: RawDetail, names: np.ndarray, windows: list[tuple[int, float, float]], t0_us: float,
                   label: Any, host: str, tid_device: dict[int, str], s_tid: np.ndarray, starts_ends: _Times,
                   parent: np.ndarray, s_name: np.ndarray,
                   operators: pd.DataFrame, gpu_memory: Mapping[int, tuple[array, array, array]],
                   cumulative_gpus: set[int], label_of_gpus: bool) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str]]:
    notes: list[str] = []
    m_ts, m_tid, m_gpu = _np(raw, "m_ts"), _np(raw, "m_tid"), _np(raw, "m_gpu")
    m_addr, m_bytes, m_alloc, m_res = _np(raw, "m_addr"), _np(raw, "m_bytes"), _np(raw, "m_alloc"), _np(raw, "m_res")
    # CPU memory: its thread's device where threads are devices (dpprof's CPU workers), the process's device in a
    # trace without GPUs, else "host" (the process's memory, not a GPU's)
    cpu_label = host if not label_of_gpus else HOST_MEMORY
    m_dev = np.array([label(int(g)) if g >= 0 else tid_device.get(int(t), cpu_label) for g, t in zip(m_gpu, m_tid)],
                     dtype=object) if len(m_ts) else np.zeros(0, dtype=object)
    step_starts = np.array([w[1] for w in windows]) if windows else np.zeros(0)
    step_ids = [w[0] for w in windows]
    step_ends = np.array([w[2] for w in windows]) if windows else np.zeros(0)

    def step_at(t: float) -> int | None:
        k = int(np.searchsorted(step_starts, t, "right")) - 1
        return step_ids[k] if 0 <= k < len(step_ids) and t <= step_ends[k] else None

    curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = {}
    for gpu, columns in gpu_memory.items():  # the allocator curve dpprof draws: read as it is
        t_us, allocated, reserved = (np.frombuffer(a, dtype=np.float64) if len(a) else np.zeros(0) for a in columns)
        curves[label(int(gpu))] = (t_us, allocated, reserved, gpu in cumulative_gpus)
    cpu = m_gpu < 0
    if cpu.any():
        split = bool(tid_device) and len({tid_device.get(int(t), host) for t in m_tid[cpu]}) > 1
        for dev in sorted(set(m_dev[cpu].tolist())):
            mine = np.flatnonzero(cpu & (m_dev == dev))
            mine = mine[np.argsort(m_ts[mine], kind="stable")]
            total = m_alloc[mine]
            cumulative = split or bool(np.isnan(total).any())
            if cumulative:  # running sum of Bytes, never below 0 (collect's rule for the 2021 format)
                run, acc = [], 0.0
                for b in m_bytes[mine].tolist():
                    acc = min(max(acc + b, 0.0), float(MAX_BYTES))
                    run.append(acc)
                total = np.array(run)
            curves[dev] = (m_ts[mine], total, np.full(len(mine), np.nan) if cumulative else m_res[mine], cumulative)
    timeline_rows: list[pd.DataFrame] = []
    peak_rows = []
    for dev, (t_us, allocated, reserved, summed) in sorted(curves.items()):
        if not len(t_us):
            continue
        k = int(np.argmax(allocated))
        t_ms = (t_us - t0_us) / 1e3
        peak_rows.append({"device": dev, "peak_allocated_bytes": int(allocated[k]),
                          "peak_reserved_bytes": int(np.nanmax(reserved)) if not np.isnan(reserved).all() else None,
                          "peak_t_ms": float(t_ms[k]), "peak_step": step_at(float(t_us[k])), "readings": len(t_us),
                          "cumulative": bool(summed)})
        timeline_rows.append(_bucketed(dev, t_ms, allocated, reserved))
    timeline = pd.concat(timeline_rows, ignore_index=True) if timeline_rows else _empty(MEMORY_TIMELINE_COLUMNS)
    peaks = pd.DataFrame(peak_rows, columns=MEMORY_PEAK_COLUMNS)
    peaks["peak_step"] = peaks["peak_step"].astype("Int64")
    peaks["peak_reserved_bytes"] = peaks["peak_reserved_bytes"].astype("Int64")

    # memory events: allocation and free paired by address on a device
    if not len(m_ts):
        return timeline, peaks, _empty(MEMORY_EVENT_COLUMNS), _empty(OPERATOR_MEMORY_COLUMNS), notes
    # ids, not strings, a memory event (there may be millions): its device's code and its operator's name id
    inner = _innermost(s_tid, *starts_ends(), parent, m_tid, m_ts)
    op_id = np.where(inner >= 0, s_name[np.maximum(inner, 0)] if len(s_name) else -1, -1).astype(np.int64)
    del inner
    dev_labels = sorted(set(m_dev.tolist()))
    dev_code = np.array([dev_labels.index(d) for d in m_dev.tolist()], dtype=np.int64) if len(dev_labels) > 1 \
        else np.zeros(len(m_ts), dtype=np.int64)
    alloc = m_bytes > 0
    inside = op_id >= 0
    key = dev_code[inside] * max(len(raw.names), 1) + op_id[inside]
    groups, which = np.unique(key, return_inverse=True)
    got_alloc, nbytes = alloc[inside], m_bytes[inside]
    op_memory = pd.DataFrame({
        "device": [dev_labels[int(k) // max(len(raw.names), 1)] for k in groups],
        "name": [raw.names[int(k) % max(len(raw.names), 1)] for k in groups],
        "allocations": np.bincount(which, weights=got_alloc, minlength=len(groups)).astype(np.int64),
        "allocated_bytes": np.bincount(which, weights=np.where(got_alloc, nbytes, 0), minlength=len(groups)),
        "frees": np.bincount(which, weights=nbytes < 0, minlength=len(groups)).astype(np.int64),
        "freed_bytes": np.bincount(which, weights=np.where(nbytes < 0, -nbytes, 0), minlength=len(groups))})
    del key, which, got_alloc, nbytes
    for column in ("allocated_bytes", "freed_bytes"):
        op_memory[column] = op_memory[column].round().astype(np.int64)
    calls = {(d, n): c for d, n, c in zip(operators["device"], operators["name"], operators["calls"])}
    op_memory["calls"] = [int(calls.get((d, n), 0)) for d, n in zip(op_memory["device"], op_memory["name"])]
    op_memory["size_increase_bytes"] = op_memory["allocated_bytes"] - op_memory["freed_bytes"]
    op_memory = op_memory[OPERATOR_MEMORY_COLUMNS].sort_values("allocated_bytes", ascending=False, kind="stable")

    with_addr = np.flatnonzero(m_addr >= 0)
    if not len(with_addr):
        notes.append("the [memory] events carry no address (Addr; the 2021 format): allocations and frees are not "
                     "paired, so no allocation's lifetime is known (the memory events table is empty); the curve and "
                     "the per-operator statistics are read as usual")
        return timeline, peaks, _empty(MEMORY_EVENT_COLUMNS), op_memory.reset_index(drop=True), notes
    with_addr = with_addr[np.lexsort((m_ts[with_addr], dev_code[with_addr]))]  # by device, then time
    with_addr = with_addr[m_bytes[with_addr] != 0]
    # each address's events on a device in time order: an allocation's free is the next event there if that is a
    # free; another allocation first (or nothing) leaves its free unknown (NaN); a free with no allocation open at
    # its address pairs with nothing
    in_group = np.lexsort((np.arange(len(with_addr)), m_addr[with_addr], dev_code[with_addr]))
    g = with_addr[in_group]
    g_dev, g_size = dev_code[g], m_bytes[g]
    freed_next = np.zeros(len(g), dtype=bool)
    freed_next[:-1] = (g_dev[1:] == g_dev[:-1]) & (m_addr[g][1:] == m_addr[g][:-1]) & (g_size[1:] < 0)
    allocs = np.flatnonzero(g_size > 0)
    allocs = allocs[np.argsort(in_group[allocs], kind="stable")]  # the pairs in their allocations' order
    p_dev, p_op, p_bytes, p_at = g_dev[allocs], op_id[g[allocs]], g_size[allocs].astype(np.int64), m_ts[g[allocs]]
    p_free = np.full(len(allocs), np.nan)
    closed = freed_next[allocs]
    p_free[closed] = m_ts[g[allocs[closed] + 1]]
    n_pairs = len(p_bytes)
    keep = np.arange(n_pairs)
    sizes = p_bytes
    if n_pairs > MEMORY_EVENTS_KEPT:
        notes.append(f"{n_pairs - MEMORY_EVENTS_KEPT:,} of {n_pairs:,} memory events (the smallest "
                     f"allocations) left out of the memory events table: it keeps the {MEMORY_EVENTS_KEPT:,} "
                     "largest; every one counts in the per-operator statistics")
        keep = np.sort(np.argsort(-sizes, kind="stable")[:MEMORY_EVENTS_KEPT])
    at_us, free_us, ops_kept = p_at[keep].astype(np.float64), p_free[keep], p_op[keep].astype(np.int64)
    events = pd.DataFrame({
        "device": [dev_labels[d] for d in p_dev[keep].tolist()],
        "operator": [raw.names[o] if o >= 0 else None for o in ops_kept.tolist()],
        "bytes": sizes[keep], "alloc_t_ms": (at_us - t0_us) / 1e3, "free_t_ms": (free_us - t0_us) / 1e3,
        "lifetime_ms": (free_us - at_us) / 1e3})
    events = events.sort_values("alloc_t_ms", kind="stable")[MEMORY_EVENT_COLUMNS].reset_index(drop=True)
    return timeline, peaks, events, op_memory.reset_index(drop=True), notes


def _bucketed(dev: str, t_ms: np.ndarray, alloc: np.ndarray, res: np.ndarray) -> pd.DataFrame:
    """A device's memory curve in at most MEMORY_POINTS points: each bucket of time its maximum, so that no peak
    is lost (the charts draw these points as they are)."""
    order = np.argsort(t_ms, kind="stable")
    t_ms, alloc, res = t_ms[order], alloc[order], res[order]
    if len(t_ms) <= MEMORY_POINTS:
        return pd.DataFrame({"device": dev, "t_ms": t_ms, "allocated_bytes": alloc.astype(np.int64),
                             "reserved_bytes": pd.array([None if math.isnan(r) else int(r) for r in res], dtype="Int64")})
    lo, hi = float(t_ms[0]), float(t_ms[-1])
    width = (hi - lo) / MEMORY_POINTS or 1.0
    bucket = np.minimum(((t_ms - lo) / width).astype(np.int64), MEMORY_POINTS - 1)
    df = pd.DataFrame({"b": bucket, "t_ms": t_ms, "allocated_bytes": alloc, "reserved_bytes": res})
    out = df.groupby("b").agg(t_ms=("t_ms", "first"), allocated_bytes=("allocated_bytes", "max"),
                              reserved_bytes=("reserved_bytes", "max")).reset_index(drop=True)
    out.insert(0, "device", dev)
    out["allocated_bytes"] = out["allocated_bytes"].astype(np.int64)
    out["reserved_bytes"] = pd.array([None if math.isnan(r) else int(r) for r in out["reserved_bytes"]], dtype="Int64")
    return out


def _modules(raw: RawDetail, names: np.ndarray, s_tid: np.ndarray, starts_ends: _Times, dev_self: np.ndarray,
             tid_device: dict[int, str], host: str) -> pd.DataFrame:
    py_ts, py_dur, py_tid, py_name = _np(raw, "py_ts"), _np(raw, "py_dur"), _np(raw, "py_tid"), _np(raw, "py_name")
    py_end = py_ts + py_dur
    if not len(py_ts):
        return _empty(MODULE_COLUMNS)
    m_order, m_parent, _ = _nest(py_tid, py_ts, py_dur)
    n = len(m_order)
    s_name = py_name[m_order]
    paths: list[str] = []
    for k in range(n):
        p = int(m_parent[k])
        own = str(names[s_name[k]])
        paths.append(f"{paths[p]}/{own}" if p >= 0 else own)
    # each op (in the ops' sorted order) in its innermost module occurrence
    inner = _innermost(py_tid[m_order], py_ts[m_order], py_end[m_order], m_parent, s_tid, starts_ends()[0])
    ops_in = np.zeros(n, dtype=np.int64)
    dev = np.zeros(n)
    has = inner >= 0
    np.add.at(ops_in, inner[has], 1)
    np.add.at(dev, inner[has], dev_self[has])
    par = m_parent.tolist()
    for k in range(n - 1, -1, -1):
        if par[k] >= 0:
            dev[par[k]] += dev[k]
    df = pd.DataFrame({"device": [tid_device.get(int(t), host) for t in py_tid[m_order]], "path": paths,
                       "module": [str(names[i]) for i in s_name],
                       "parent": [paths[p] if p >= 0 else None for p in par],
                       "host_ms": py_dur[m_order] / 1e3, "ops": ops_in, "dev": dev / 1e3})
    out = df.groupby(["device", "path", "module"], sort=False, dropna=False).agg(
        parent=("parent", "first"), occurrences=("host_ms", "size"), operators=("ops", "sum"),
        host_total_ms=("host_ms", "sum"), device_total_ms=("dev", "sum")).reset_index()
    if not len(_np(raw, "k_ts")):
        out["device_total_ms"] = np.nan
    return out[MODULE_COLUMNS]


def detail_of_trace(path: str | Any, device_of_thread: Mapping[int, str] | None = None,
                    t0_us: float | None = None, process_device: str | None = None,
                    first_step_ms: float | None = None) -> Detail:
    """The operator, kernel, GPU-metric, memory and module tables of one torch.profiler trace file.

    For a trace dpprof recorded of its own run (a deep capture on CPU worker threads): each thread's ops and CPU
    memory go to the device ``device_of_thread`` names for its tid (the OS thread id torch.profiler writes);
    threads it does not name go to the process's device (``cpu:0``, or the GPU it launched most kernels to).
    Steps are the trace's ``ProfilerStep#N`` ranges, else the whole trace is one step (0).

    Args:
        path: a ``.json`` or ``.json.gz`` torch.profiler trace.
        device_of_thread: tid -> device label ("cpu:0", "cuda:1").
        t0_us: the time the ``t_ms`` columns count from, in the trace's µs (default: the first step's start, else
            the trace's first event).
        process_device: the device of the threads ``device_of_thread`` does not name where the trace shows no GPU
            (default cpu:0; a DDP or FSDP rank's: "rank:N").
        first_step_ms: when the trace's first step began on a run's own clock (a deep capture's window of a
            recorded run): the ``t_ms`` columns count from that run's start, as its steps' and phases' do.

    Raises:
        TraceError: the file cannot be read as a trace (one line naming it and why).

    Example:
        >>> detail = detail_of_trace("capture.pt.trace.json", {41233: "cpu:0", 41234: "cpu:1"})
        >>> detail.operators.head()
    """
    c = collect(TraceFile(path))
    windows = list(c.steps) or ([(0, c.first_us, c.last_us)] if c.last_us >= c.first_us else [])
    origin = t0_us if t0_us is not None else (windows[0][1] if windows else 0.0)
    if first_step_ms is not None and windows and t0_us is None:
        origin = windows[0][1] - first_step_ms * 1e3
    gpus = c.gpus
    host = f"cuda:{gpus[0]}" if gpus else (process_device or "cpu:0")
    return detail_tables(c.detail, windows, origin, {g: f"cuda:{g}" for g in gpus}, host, device_of_thread,
                         c.memory, c.memory_cumulative)
