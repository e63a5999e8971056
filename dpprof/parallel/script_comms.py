"""The script's own collectives in a recorded DDP or FSDP run.

A training script calls torch.distributed itself beside DDP's and FSDP's collectives: a metric or the loss
all-reduced for logging after the optimizer step, an early-stopping flag broadcast, a barrier before a checkpoint.
A rank that is late to one (rank 0 writing a log or a checkpoint after its step) makes the others wait inside it,
and without this module that wait was the next step's data part on every rank: the straggler went unseen.

Each such call made in a recording process is timed: its host time is the part ``script_comm`` of the rank's step
(dpprof.stepmodel: before ``data``, so the gap before forward holds the loading, not the wait), and it is a row
of the comms table (``records.SCRIPT_BUCKET``: no bucket of DDP's or FSDP's) that the straggler verdict matches
across ranks (dpprof.findings.collectives). A call is the script's where the frame that made it is not torch's
nor dpprof's: DDP's buckets, FSDP's all-gathers, SyncBatchNorm's and torch.distributed's own helpers are left
to their own records. A call with ``async_op=True`` is a row from its launch to its future's completion (its
wait is where the script waits on it, not timed as a part).

A call inside a step (``run.step()``, or an implicit step before its optimizer stepped) is that step's; one
between steps (after the optimizer, before the next forward) is the next step's, settled when its forward
starts (``settle``); one before the first step or after the last is in no step, and not recorded.

The collectives are wrapped once a process: by ``dpprof run`` (dpprof.instrument) before the script starts, so a
name the script binds itself (``from torch.distributed import all_reduce``) is the timed one, and else at the first
recorded DDP or FSDP forward (a ``dpprof.record`` block). A name bound before that holds torch's own function: the
names modules hold (the script's ``from torch.distributed import all_reduce`` at its top) are bound to the timed
collectives then (``_rebind``); a function's local name, which cannot be, stays torch's, untimed, and the run's notes
say so. One held elsewhere (an attribute, a closure, a default argument) is neither timed nor said.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
import types
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from dpprof.recording import Run, current_run
from dpprof.records import ALL_REDUCE, COMM_ROW, PHASE_ROW, SCRIPT_BUCKET

__all__ = ["SCRIPT_COMM", "install", "settle", "outside", "skip_wrapper", "COLLECTIVE_WORDS"]

SCRIPT_COMM = "script_comm"  # the phase: the host's time inside the script's own blocking collectives
# torch.distributed's collectives a script calls, and the word each is stored as (an imported trace's words,
# dpprof.trace.collect.COLLECTIVES)
COLLECTIVE_WORDS = {
    "all_reduce": ALL_REDUCE, "all_gather": "all-gather", "all_gather_into_tensor": "all-gather",
    "all_gather_object": "all-gather", "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast", "reduce": "reduce", "all_to_all": "all-to-all",
    "all_to_all_single": "all-to-all", "barrier": "barrier", "monitored_barrier": "barrier", "gather": "gather",
    "gather_object": "gather", "scatter": "scatter", "scatter_object_list": "scatter",
}
# the calls held for the next step's forward at most: a loop of collectives with no recorded forward between them
# keeps the newest (the next step's window starts at the last step's end: older ones are in no step anyway)
HELD_MAX = 4096
_lock = threading.Lock()
_wrapper_codes: set[Any] = set()  # the code of every wrapper of a collective: frames skipped to find the caller
_labels: dict[int, str] = {}  # rank -> "rank:N"


def _label() -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    label = _labels.get(rank)
    if label is None:
        label = _labels[rank] = f"rank:{rank}"  # dpprof.device_ids.rank_devices' label
    return label


def _is_framework(module: str) -> bool:
    """Whether the module named ``module`` is torch's or dpprof's (its calls are not the script's)."""
    return module.split(".", 1)[0] in ("torch", "dpprof")


def _from_script(frame: Any) -> bool:
    """Whether the call whose wrapper's caller is ``frame`` was made by the script: the first frame that is no
    wrapper of a collective (dpprof's byte counting wraps them too) is not torch's nor dpprof's."""
    while frame is not None and frame.f_code in _wrapper_codes:
        frame = frame.f_back
    if frame is None:
        return False
    return not _is_framework(frame.f_globals.get("__name__") or "")


def _bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The bytes of the call's first tensor (or first list of tensors): what it sends; None where it takes none."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            return sum(t.numel() * t.element_size() for t in value)
    return None


class _Call(NamedTuple):
    """One call of the script's, as held for the next step's forward (Run.script_comms)."""

    label: str  # its rank's device label
    word: str  # the collective (COLLECTIVE_WORDS)
    nbytes: int | None
    t0: int  # launch and completion, perf_counter_ns
    t1: int
    blocking: bool  # the host waited in it (a part), not an async_op call (a row alone)
    emitted: bool  # already in the step it was made in (_record), not held for the next


def _record(run: Run, word: str, nbytes: int | None, t0: int, t1: int, blocking: bool) -> None:
    """One call: into the step it is in now, or held for the next step (``settle``). Either way it is kept until the
    next step's forward, whose data part it is carved out of."""
    step = run.step_for_collective()
    item = _Call(_label(), word, nbytes, t0, t1, blocking, step is not None)
    if step is not None:
        _emit(run, step.index, item)
        if blocking:
            step.touch(t1)
    with _lock:
        if len(run.script_comms) >= HELD_MAX:  # no recorded forward for long (an evaluation on the bare module)
            del run.script_comms[:HELD_MAX // 2]
        run.script_comms.append(item)


def _emit(run: Run, step: int, item: _Call) -> None:
    label, word, nbytes, t0, t1 = item.label, item.word, item.nbytes, item.t0, item.t1
    start_ms, duration_ms = (t0 - run._t0_ns) / 1e6, (t1 - t0) / 1e6
    if item.blocking:
        # a row (dpprof.records.Row): PHASE_ROW, then PhaseRecord's step, call, phase, device, start_ms, duration_ms,
        # device_duration_ms
        run.sink.put((PHASE_ROW, step, 0, SCRIPT_COMM, label, start_ms, duration_ms, None))
    # COMM_ROW, then CommRecord's step, device, bucket, bucket_bytes, launch_ms, duration_ms, collective
    run.sink.put((COMM_ROW, step, label, SCRIPT_BUCKET, nbytes, start_ms, duration_ms, word))


def settle(run: Run, step: Any, start_ns: int) -> list[tuple[int, int]]:
    """The script's collectives since the last step's forward: those held (``_record``) into ``step`` (a
    dpprof.recording._Step), whose window starts at ``start_ns``, from then on (its data part holds them); earlier
    ones (before the first step, or outside an explicit step) are in no step. Called by DDP's and FSDP's probes once
    a forward has opened its step, before its data part.

    Returns:
        the host spans (perf_counter_ns) of the blocking ones from ``start_ns`` on, held or already in a step: what
        the data part is not (``outside``).
    """
    if not run.script_comms:
        return []
    with _lock:
        items, run.script_comms[:] = list(run.script_comms), []
    spans = []
    for item in sorted(items, key=lambda i: i.t0):
        if item.t0 < start_ns:
            continue
        if not item.emitted:
            _emit(run, step.index, item)
        if item.blocking:
            spans.append((item.t0, item.t1))
    return spans


def outside(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) less the ``spans`` (sorted by start): the pieces of a data part around the script's collectives."""
    pieces, at = [], lo
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if a > at:
            pieces.append((at, a))
        at = max(at, b)
    if hi > at:
        pieces.append((at, hi))
    return pieces


def data_pieces(lo: int, hi: int, held: list[tuple[int, int]],
                loaded: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """A recorded rank's data part in the gap [lo, hi) before its forward (dpprof.stepmodel): the DataLoader's calls
    the rank's thread made in it (``loaded``: dpprof.loaders.take), as an imported trace's data part is its DataLoader
    ranges, else the whole gap; less the script's collectives (``held``). None where it is the whole gap, the one
    case whose GPU time is read (an event marks its start); the gap's time outside the pieces is the step's rest."""
    if not held and not loaded:
        return None
    return [piece for a, b in (loaded or [(lo, hi)]) for piece in outside(max(a, lo), min(b, hi), held)
            if piece[1] > piece[0]]


def _timed(collective: Callable[..., Any], word: str) -> Callable[..., Any]:
    @functools.wraps(collective)
    def script_collective(*args: Any, **kwargs: Any) -> Any:
        run = current_run()
        if run is None or not run.records_comms or not _from_script(sys._getframe(1)):
            return collective(*args, **kwargs)
        nbytes = _bytes(args, kwargs)
        t0 = time.perf_counter_ns()
        out = collective(*args, **kwargs)
        t1 = time.perf_counter_ns()
        if out is None or not kwargs.get("async_op"):
            _record(run, word, nbytes, t0, t1, blocking=True)
            return out
        try:
            future = out.get_future()
        except (AttributeError, RuntimeError):  # a backend's work without a future: its time is not known
            return out
        future.add_done_callback(lambda _: _record(run, word, nbytes, t0, time.perf_counter_ns(), blocking=False))
        return out

    _wrapper_codes.add(script_collective.__code__)  # type: ignore[attr-defined]
    script_collective._dpprof_script = True  # type: ignore[attr-defined]
    return script_collective


def install(run: Run | None = None) -> None:
    """Time the script's own calls of torch.distributed's collectives (once a process; every later call passes
    through when no run records DDP or FSDP). ``run``: the run recording now, where the script may have bound names to
    torch's collectives already (``_rebind``)."""
    if not dist.is_available():
        return
    timed: dict[int, tuple[Any, Any]] = {}  # id of torch's function -> (it, its timed wrapper)
    with _lock:
        for name, word in COLLECTIVE_WORDS.items():
            collective = getattr(dist, name, None)
            if collective is not None and not getattr(collective, "_dpprof_script", False):
                wrapper = _timed(collective, word)
                setattr(dist, name, wrapper)
                own = collective
                # the function under DDP's byte counting (dpprof.parallel.distributed), which wrapped it first: the
                # one the script holds
                while getattr(own, "_dpprof_counting", False):
                    own = own.__wrapped__
                timed[id(own)] = (own, wrapper)
    if timed and run is not None:
        _rebind(run, timed, sys._getframe(1))


def _rebind(run: Run, timed: dict[int, tuple[Any, Any]], frame: Any) -> None:
    """Bind ``timed``'s wrappers in place of torch's functions to the names modules other than torch's and dpprof's
    hold (the script's ``from torch.distributed import all_reduce``, bound before install: a global, looked up at each
    call); note each local name of a function on the stack from ``frame`` up that holds one, which cannot be rebound.
    Once a process, at the first recorded DDP or FSDP forward: some 20 ms over a thousand modules."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        # not module.__dict__: a lazily loaded module (importlib.util.LazyLoader) would be loaded by the look
        namespace = object.__getattribute__(module, "__dict__")
        if _is_framework(str(namespace.get("__name__") or "")):
            continue
        for key, value in list(namespace.items()):
            found = timed.get(id(value))
            if found is not None and found[0] is value:
                namespace[key] = found[1]
    while frame is not None:
        code = frame.f_code
        if frame.f_locals is not frame.f_globals and not _is_framework(frame.f_globals.get("__name__") or ""):
            for key, value in frame.f_locals.items():
                found = timed.get(id(value))
                if found is not None and found[0] is value:
                    name = value.__name__
                    run.note("dpprof", f"the script's {key} in {code.co_name}() ({os.path.basename(code.co_filename)}) "
                             f"is torch.distributed's {name}, bound before the first recorded forward to a local name "
                             f"dpprof cannot rebind: its calls are not timed (call torch.distributed.{name} there, or "
                             "record with dpprof run, which times it from the start)", tell=False)
        frame = frame.f_back


def skip_wrapper(code: Any) -> None:
    """Another wrapper of a collective (dpprof's byte counting): its frame is not the caller."""
    _wrapper_codes.add(code)
