"""CPU workers as devices: one long-lived thread per worker index, as each GPU has its own stream.

A forward call hands each replica to its worker's thread and waits for them all, as torch's
parallel_apply does with one thread per replica; the threads outlive the call, so a step pays
a hand-off, not a thread start and the per-thread set-up torch does on a thread's first op.
The hand-off is a put on the worker's queue and a get on the call's: queue.SimpleQueue is one
lock in C each way (a concurrent.futures executor costs twice the time, in Python, per task).

Each worker runs its ops with its share of the intra-op threads (the caller's count divided by
the number of workers in the call, at least one): two workers on two cores compute side by
side, like two GPUs, instead of each forking a team as large as the machine.

The caller's own OpenMP helper threads spin for milliseconds after each of the caller's parallel
ops (libgomp's default wait policy; ~8 ms on a 2-core machine), on the cores the workers need
next: the optimizer's step, then the next forward's replicas. Before a long call the caller
releases them (omp_pause_resource_all, OpenMP 5.0); its next parallel op starts them again,
which costs ~0.2 ms, so a call is preceded by the release only when the calls before it took
longer than PAUSE_AFTER_S.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["run_on_workers", "on_worker_thread", "worker_index", "worker_native_ids"]

_local = threading.local()  # .index: set on a worker's own thread
# each worker thread's OS thread id (the tid torch.profiler writes in a trace) -> its worker index, set as it starts
_native_ids: dict[int, int] = {}

# A call that follows calls at least this long (the last PAUSE_WINDOW of them: one slow call, a hiccup
# between short ones, does not count) releases the caller's OpenMP helper threads first: their spin
# costs the workers up to ~8 ms of a core, starting them again ~0.2 ms of the caller's.
PAUSE_AFTER_S = 0.002
PAUSE_WINDOW = 3
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's omp_pause_soft


def _find_omp_pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all of the OpenMP runtime torch loaded, or None. libgomp's releases the calling
    thread's own helpers (its thread pool) and nothing else; LLVM's and Intel's put idle threads to sleep
    until the next parallel region."""
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError, TypeError):  # no such symbol, or no process-wide lookup (Windows)
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


_omp_pause = _find_omp_pause()
# how long the last PAUSE_WINDOW run_on_workers calls of each kind waited, oldest first (a kind's first
# calls release): a model's forward is judged by its forwards, not by a criterion's calls or the copies
# made between them
_recent_s: dict[Hashable, list[float]] = {}


class _Escaped:
    """A task's exception that the task did not catch, to be raised again in the caller."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _serve(index: int, tasks: queue.SimpleQueue) -> None:
    """A worker's thread: run each task it is handed, in order, and put (slot, result) on the call's queue."""
    _local.index = index
    _native_ids[threading.get_native_id()] = index
    # torch sets a thread's intra-op count from its process-wide count on the thread's first parallel op
    # (at::internal::lazy_init_num_threads); asking for the count does that now, so that the share set
    # below is not replaced later by the caller's count (a worker whose first ops were all too small to
    # run in parallel went on to run its larger ones with as many threads as the caller)
    torch.get_num_threads()
    while True:
        threads, task, slot, done = tasks.get()
        if threads:
            # torch.set_num_threads on this thread sets this thread's count; it also sets the count
            # new threads start with, which the caller puts back
            torch.set_num_threads(threads)
        try:
            result = task()
        except BaseException as err:  # noqa: BLE001 - handed to the caller, who raises it
            result = _Escaped(err)
        del task
        done.put((slot, result))
        del result


class _Worker:
    """One CPU worker: a daemon thread serving its queue, keeping its own intra-op thread count."""

    __slots__ = ("index", "tasks", "threads")

    def __init__(self, index: int) -> None:
        self.index = index
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = 0  # the intra-op thread count set on this worker's thread (0: not yet)
        threading.Thread(target=_serve, args=(index, self.tasks), name=f"dpprof-cpu:{index}", daemon=True).start()


_workers: dict[int, _Worker] = {}
_workers_lock = threading.Lock()


def _forget_workers() -> None:
    """In a forked child the parent's threads do not exist: start from no workers, and never release the caller's
    OpenMP helper threads: the child's OpenMP runtime still lists the parent's, and libgomp's release waits for
    them to answer, forever."""
    global _workers_lock, _omp_pause
    _workers.clear()
    _native_ids.clear()
    _workers_lock = threading.Lock()
    _omp_pause = None


os.register_at_fork(after_in_child=_forget_workers)


def _worker(index: int) -> _Worker:
    worker = _workers.get(index)
    if worker is None:
        with _workers_lock:
            worker = _workers.get(index)
            if worker is None:
                worker = _workers[index] = _Worker(index)
    return worker


def worker_index(device: int | str | torch.device) -> int:
    """The CPU worker a device id names: N for N, "cpu:N" or torch.device("cpu", N); 0 for a bare "cpu"."""
    return device if isinstance(device, int) else torch.device(device).index or 0


def worker_native_ids() -> dict[int, int]:
    """Each started CPU worker thread's OS thread id (``threading.get_native_id()``, the ``tid`` torch.profiler
    writes for the ops it runs) and its worker index: a deep capture maps each thread's ops to its device."""
    return dict(_native_ids)


def on_worker_thread() -> bool:
    """Whether the calling thread is one of the CPU workers' own threads."""
    return getattr(_local, "index", None) is not None


def run_on_workers(indices: Sequence[int], tasks: Sequence[Callable[[], Any]],
                   kind: Hashable = None) -> list[Any]:
    """Run ``tasks[i]`` on CPU worker ``indices[i]``'s thread, all at once; their results in order.

    A task's exception is its result's business: tasks are expected to catch and wrap their own
    (parallel_apply's ExceptionWrapper); one that escapes is re-raised here, after every task ended.
    ``kind`` names calls alike in length, whose last durations decide whether the caller releases its
    OpenMP helper threads first.
    """
    share = max(1, torch.get_num_threads() // max(1, len(indices)))
    recent = _recent_s.get(kind)
    if recent is None:
        recent = _recent_s.setdefault(kind, [float("inf")] * PAUSE_WINDOW)
    if _omp_pause is not None and min(recent) >= PAUSE_AFTER_S:
        _omp_pause(_OMP_PAUSE_SOFT)  # the caller's helper threads exit; a no-op where it has none
    t0 = time.perf_counter()
    done: queue.SimpleQueue = queue.SimpleQueue()
    resized = False
    n = 0
    for slot, (index, task) in enumerate(zip(indices, tasks, strict=True)):
        worker = _worker(index)
        threads = 0
        if worker.threads != share:
            threads = worker.threads = share
            resized = True
        worker.tasks.put((threads, task, slot, done))
        n += 1
    results: list[Any] = [None] * n
    for _ in range(n):
        slot, result = done.get()
        results[slot] = result
    recent.append(time.perf_counter() - t0)
    del recent[0]
    if resized:
        torch.set_num_threads(torch.get_num_threads())  # the caller's own count, for threads started later
    for result in results:
        if isinstance(result, _Escaped):
            raise result.error
    return results
