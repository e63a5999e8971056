"""CPU workers as devices: one long-lived thread per worker index, as each GPU has its own stream.

A forward call hands each replica to its worker's thread and waits for them all, as torch's
parallel_apply does with one thread per replica; the threads outlive the call, so a step pays
a hand-off, not a thread start and the per-thread set-up torch does on a thread's first op.

Each worker runs its ops with its share of the intra-op threads (the caller's count divided by
the number of workers in the call, at least one): two workers on two cores compute side by
side, like two GPUs, instead of each forking a team as large as the machine.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["run_on_workers", "on_worker_thread"]

_local = threading.local()  # .index: set on a worker's own thread


class _Worker:
    """One CPU worker: a single-thread executor whose thread keeps its own intra-op thread count."""

    __slots__ = ("index", "executor", "threads")

    def __init__(self, index: int) -> None:
        self.index = index
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"dpprof-cpu:{index}",
                                           initializer=_mark_worker, initargs=(index,))
        self.threads = 0  # the intra-op thread count set on this worker's thread (0: not yet)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.executor.submit(fn, *args)


def _mark_worker(index: int) -> None:
    _local.index = index


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


def on_worker_thread() -> bool:
    """Whether the calling thread is one of the CPU workers' own threads."""
    return getattr(_local, "index", None) is not None


def _set_threads(count: int) -> None:
    torch.set_num_threads(count)


def run_on_workers(indices: Sequence[int], tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``tasks[i]`` on CPU worker ``indices[i]``'s thread, all at once; their results in order.

    A task's exception is its result's business: tasks are expected to catch and wrap their own
    (parallel_apply's ExceptionWrapper); one that escapes is re-raised here.
    """
    share = max(1, torch.get_num_threads() // max(1, len(indices)))
    workers = [_worker(i) for i in indices]
    resized = False
    futures = []
    for worker, task in zip(workers, tasks, strict=True):
        if worker.threads != share:
            # torch.set_num_threads on the worker's thread sets that thread's count; it also sets
            # the count new threads start with, which is put back below
            worker.submit(_set_threads, share)
            worker.threads = share
            resized = True
        futures.append(worker.submit(task))
    results = [f.result() for f in futures]
    if resized:
        torch.set_num_threads(torch.get_num_threads())  # the caller's own count, for threads started later
    return results
