"""CPU workers as devices: one long-lived thread per worker index, as each GPU has its own stream.

A forward call hands each replica to its worker's thread and waits for them all, as torch's
parallel_apply does with one thread per replica; the threads outlive the call, so a step pays
a hand-off, not a thread start and the per-thread set-up torch does on a thread's first op.
The hand-off is a put on the worker's queue and a get on the call's: queue.SimpleQueue is one
lock in C each way (a concurrent.futures executor costs twice the time, in Python, per task).

Each worker runs its ops with its share of the intra-op threads (the caller's count divided by
the number of workers in the call, at least one): two workers on two cores compute side by
side, like two GPUs, instead of each forking a team as large as the machine.
"""
from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["run_on_workers", "on_worker_thread", "worker_index"]

_local = threading.local()  # .index: set on a worker's own thread


class _Escaped:
    """A task's exception that the task did not catch, to be raised again in the caller."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _serve(index: int, tasks: queue.SimpleQueue) -> None:
    """A worker's thread: run each task it is handed, in order, and put (slot, result) on the call's queue."""
    _local.index = index
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
    """In a forked child the parent's threads do not exist: start from no workers."""
    global _workers_lock
    _workers.clear()
    _workers_lock = threading.Lock()


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


def on_worker_thread() -> bool:
    """Whether the calling thread is one of the CPU workers' own threads."""
    return getattr(_local, "index", None) is not None


def run_on_workers(indices: Sequence[int], tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``tasks[i]`` on CPU worker ``indices[i]``'s thread, all at once; their results in order.

    A task's exception is its result's business: tasks are expected to catch and wrap their own
    (parallel_apply's ExceptionWrapper); one that escapes is re-raised here, after every task ended.
    """
    share = max(1, torch.get_num_threads() // max(1, len(indices)))
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
    if resized:
        torch.set_num_threads(torch.get_num_threads())  # the caller's own count, for threads started later
    for result in results:
        if isinstance(result, _Escaped):
            raise result.error
    return results
