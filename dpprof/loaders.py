"""What a run's DataLoaders were set to: whether they load in worker processes, and how (the data_loading finding's
advice follows it, never advising what the job already does).

A recorded run notes each DataLoader the recording process iterates (``DataLoader.__iter__``, once an epoch) into
its workload_args' ``data_loaders``: ``num_workers``, ``persistent_workers``, ``pin_memory``, ``prefetch_factor``.
A run recorded since the watch says so from its start (``data_loaders: []``), so ``[]`` read back is "watched, none
iterated" (the script built its batches itself), and no ``data_loaders`` at all is "not said" (a file written
before, an imported trace without DataLoader ranges).
The watch is on from ``import dpprof`` (``watch``: once torch's DataLoader is imported, never loading torch
itself), so a DataLoader whose iterator was made before the run started (``it = iter(loader)`` before
``dpprof.record``, or before DDP is built under torchrun, where the run starts) is seen: what is iterated while no
run records is kept, while its iterator lives (``MAX_LOADERS``, the newest), for the next run to start
(``claim``): a loop over a loader that ended before the run is no loader of it.
An imported trace says only which iterator ran (torch.profiler names the range
``enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__`` or ``..._SingleProcessDataLoaderIter...``): workers
or none, not how many. Importing this module loads no torch (the read side uses it).

The watch also times each batch a DataLoader's iterator makes (its ``_next_data``, the work inside torch.profiler's
``enumerate(DataLoader)#...__next__`` range), on whichever thread asks, into a short log (``CALLS_KEPT`` calls, the
newest): a recorded DDP or FSDP rank takes its own thread's calls from it as its forward starts (``take``), and its
data part is those calls, as an imported trace's data part is its DataLoader ranges (dpprof.stepmodel). A
DataParallel step, which holds no data part, reads (``time_in``) the DataLoader's time between the step before it and
itself (StepRecord.loader_ms). An iterator
made before ``import dpprof`` is timed too: the classes' method is replaced, not the iterator's.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Callable

__all__ = ["MAX_LOADERS", "WORKERS_ITER", "NO_WORKERS_ITER", "describe", "of_iterators", "stored", "said_in",
           "none_iterated", "exported_loaders", "install_watch", "watch", "receive", "claim", "CALLS_KEPT", "take",
           "time_in"]

MAX_LOADERS = 4  # distinct settings kept a process: a training, a validation and a test loader, and one more
WORKERS_ITER = "_MultiProcessingDataLoaderIter"  # torch.utils.data.dataloader's iterator with num_workers > 0
NO_WORKERS_ITER = "_SingleProcessDataLoaderIter"  # and with num_workers=0
# the DataLoader calls kept for a rank to take: an evaluation between two steps of more batches than this keeps its
# newest (the older ones' time is then the step's rest, not its data part)
CALLS_KEPT = 4096

_installed: list[Callable[..., Any]] = []
_lock = threading.Lock()
_receivers: list[Callable[[dict[str, Any]], bool]] = []  # dpprof.recording's: True where a run kept the loader
# loaders iterated while no run recorded (describe), each with a weak reference to its iterator, the newest last
_unclaimed: list[tuple[dict[str, Any], Callable[[], Any]]] = []
# each batch a DataLoader's iterator made, oldest first: (thread ident, start ns, end ns), perf_counter_ns's clock
_calls: deque[tuple[int, int, int]] = deque(maxlen=CALLS_KEPT)


def describe(loader: Any) -> dict[str, Any]:
    """One DataLoader's settings that decide how it loads (what ``data_loaders`` holds for a recorded run)."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    prefetch = getattr(loader, "prefetch_factor", None)
    return {"workers": workers > 0, "num_workers": workers,
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "prefetch_factor": int(prefetch) if workers > 0 and isinstance(prefetch, int) else None}


def of_iterators(names: Iterable[str]) -> list[dict[str, Any]]:
    """What a trace's ``enumerate(DataLoader)#...`` ranges say of its loaders: workers or none (not how many)."""
    seen = {WORKERS_ITER in n for n in names if WORKERS_ITER in n or NO_WORKERS_ITER in n}
    return [{"workers": w} for w in sorted(seen, reverse=True)]


def stored(value: Any) -> list[dict[str, Any]]:
    """The ``data_loaders`` of a run file's workload_args, as far as they are readable (a damaged or hand-edited
    file's are left out, never raised on): each a dict with a bool ``workers``."""
    if not isinstance(value, list):
        return []
    return [d for d in value[:MAX_LOADERS] if isinstance(d, dict) and isinstance(d.get("workers"), bool)]


def said_in(args: Any) -> list[dict[str, Any]] | None:
    """The DataLoaders a run file's workload_args say (``stored``): [] where the recorder watched and none was
    iterated, None where the file does not say (no ``data_loaders``: written before the watch, or a trace)."""
    if not isinstance(args, dict) or not isinstance(args.get("data_loaders"), list):
        return None
    return stored(args["data_loaders"])


def none_iterated(by_rank: dict[int, list[dict[str, Any]]], ranks: Iterable[int] | None = None) -> bool:
    """Whether the run's files say that no DataLoader was iterated in the processes of ``ranks`` (default: every rank
    in ``by_rank``, at least one): each watched and noted none (a rank that does not say is no such rank)."""
    chosen = list(by_rank) if ranks is None else [int(r) for r in ranks]
    return bool(chosen) and all(r in by_rank and not by_rank[r] for r in chosen)


def exported_loaders(info: Any, rank: int | None) -> list[dict[str, Any]] | None:
    """The DataLoaders a file dpprof export wrote says of ``rank`` (its export info's ``data_loaders``, rank ->
    settings), or of every rank in it where the file has none (a one-file run's): each once; [] where the run it
    was written from watched and none was iterated, None where it does not say."""
    by_rank = info.get("data_loaders") if isinstance(info, dict) else None
    if not isinstance(by_rank, dict):
        return None
    chosen = [by_rank.get(str(rank))] if rank is not None else list(by_rank.values())
    if not any(isinstance(found, list) for found in chosen):
        return None
    out: list[dict[str, Any]] = []
    for found in chosen:
        out += [d for d in stored(found) if d not in out]
    return out[:MAX_LOADERS]


def _note(loader: Any, iterator: Any) -> None:
    """A DataLoader is iterated: its settings to the run recording now, else kept for the next run while the
    iterator lives (``claim``: a loop over a loader done before the run, its iterator freed, is no loader of it)."""
    found = describe(loader)
    if _receivers and _receivers[0](found):
        return
    try:
        ref = weakref.ref(iterator)
    except TypeError:  # an iterator that takes no weak reference: not held (its workers would outlive it)
        return
    with _lock:
        _unclaimed[:] = [(f, r) for f, r in _unclaimed if f != found and r() is not None][-(MAX_LOADERS - 1):]
        _unclaimed.append((found, ref))


def receive(receiver: Callable[[dict[str, Any]], bool]) -> None:
    """Where the watch sends a DataLoader's settings first: ``receiver(found)`` is True where a run kept them (once a
    process: dpprof.recording's)."""
    if not _receivers:
        _receivers.append(receiver)


def claim() -> list[dict[str, Any]]:
    """The settings of the DataLoaders iterated while no run recorded whose iterators still live, the oldest first,
    handed over once: a run starting takes them (an iterator made before it, iterated inside it)."""
    with _lock:
        out = [found for found, ref in _unclaimed if ref() is not None]
        _unclaimed.clear()
    return out


def time_in(lo: int, hi: int) -> float | None:
    """The calling thread's DataLoader time inside [lo, hi) (perf_counter_ns), in ms, read from the newest calls back
    and leaving the log as it is; None where the log holds no call (no DataLoader made a batch in this process, or a
    rank took them all: its data part holds them)."""
    if not _calls:  # a step fed otherwise
        return None
    me, total = threading.get_ident(), 0
    for _ in range(2):
        try:
            for thread, a, b in reversed(_calls):  # the newest last: most gaps hold one call, read first
                if b <= lo:
                    break
                if thread == me:
                    total += max(0, min(b, hi) - max(a, lo))
            return total / 1e6
        except RuntimeError:  # another thread logged or took a call meanwhile: read again
            total = 0
    return None


def take(lo: int, hi: int) -> list[tuple[int, int]]:
    """The calling thread's DataLoader calls since the last take, clipped to [lo, hi) (perf_counter_ns), oldest
    first; every call logged so far is taken (another thread's, one outside the range: in no data part)."""
    out: list[tuple[int, int]] = []
    if not _calls:  # a step fed otherwise
        return out
    me = threading.get_ident()
    while _calls:  # most steps: one call
        try:
            thread, a, b = _calls.popleft()
        except IndexError:  # another thread took the last
            break
        a, b = max(a, lo), min(b, hi)
        if thread == me and b > a:
            out.append((a, b))
    return out


def _timed(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An iterator class's ``_next_data`` that logs its time (not ``__next__``, whose own warnings name their
    caller's frame: it would be dpprof's)."""
    @functools.wraps(original)
    def _next_data(self: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return original(self)
        finally:
            _calls.append((threading.get_ident(), t0, time.perf_counter_ns()))

    return _next_data


def install_watch() -> None:
    """Note each DataLoader iterated (``DataLoader.__iter__``, once an epoch) from now on in this process, and time
    each batch its iterators make; installed once, as torch's optimizer hooks are global. Imports torch's DataLoader
    (``watch`` waits for it)."""
    with _lock:
        if _installed:
            return
        # its module's body run, where torch.utils.data may not be
        from torch.utils.data import dataloader
        from torch.utils.data.dataloader import DataLoader

        original = DataLoader.__iter__

        @functools.wraps(original)
        def __iter__(self: Any) -> Any:
            iterator = original(self)
            try:
                _note(self, iterator)
            except Exception:  # noting must never break the script's loop
                pass
            return iterator

        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        for name in (NO_WORKERS_ITER, WORKERS_ITER):
            iterator_class = getattr(dataloader, name, None)
            if iterator_class is not None and "_next_data" in vars(iterator_class):
                iterator_class._next_data = _timed(iterator_class._next_data)
        _installed.append(original)


def watch() -> None:
    """The watch installed once torch's DataLoader is imported (now, if it is): ``import dpprof`` calls it, loading
    no torch."""
    from dpprof.imports import when_imported

    when_imported("torch.utils.data.dataloader", install_watch)
