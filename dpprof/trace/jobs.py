"""The files of one job read in separate processes (``dpprof import --jobs N``), and how many at once.

Each worker process reads and collects whole files (``dpprof.trace.collect``: the heavy part, decoding
every event) and hands back the ``Collected`` of each, a few MB of ranges and typed arrays; checking the
files against each other, converting and writing the run stay with the caller, as with one process. A
file that cannot be read stops the others at once, and its error is raised as it would be read alone.

Workers are forked where that is safe (Linux, and no other thread in the calling process that a fork
could copy in the middle of holding a lock): they start at once, with dpprof imported already.
Elsewhere (a dashboard's thread, a test runner's) they are fresh interpreters (spawn) that import only the
trace reader: 0.17 s of CPU each on a 2-core machine, where importing dpprof's store with pandas took 1.0 s.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

from dpprof.trace.collect import Collected, collect
from dpprof.trace.decode import TraceError, TraceFile

__all__ = ["default_jobs", "capped_jobs", "collect_files", "usable_cores", "available_memory_bytes", "worker_bytes"]

# What one worker may hold at its peak, to choose how many fit in memory (measured on the bench's traces:
# a spawned worker's interpreter and imports take ~106 MiB, and collecting a 252 MiB trace adds ~22 MiB of
# collected arrays and read buffers; a forked worker shares the first part with its parent). Over twice the
# measure, for margin.
WORKER_BASE_BYTES = 256 << 20
COLLECTED_PER_JSON_BYTE = 1 / 8  # collected arrays and buffers per byte of JSON read (~1/11 measured), with margin
GZIP_RATIO = 12  # JSON bytes per byte of a .json.gz, for the estimate (Kineto traces compress 8-12x)
MEMORY_SHARE = 0.5  # the workers together take at most half the memory available: the caller holds the results

log = logging.getLogger("dpprof")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_memory_bytes() -> int | None:
    """Memory that can be taken without swapping: MemAvailable, capped by a cgroup's limit; None if unknown."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: a container's limit, less what it uses already
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def worker_bytes(path: str | os.PathLike[str]) -> int:
    """What a worker reading this file may hold at its peak (an estimate, generous)."""
    path = Path(path)
    size = path.stat().st_size
    json_bytes = size * GZIP_RATIO if path.name.endswith(".gz") else size
    return WORKER_BASE_BYTES + int(json_bytes * COLLECTED_PER_JSON_BYTE)


def default_jobs(sizes_bytes: Sequence[int], cores: int | None = None, available_bytes: int | None = -1) -> int:
    """How many files to read at once: one per core, no more than the files, fewer where memory would not
    hold them (each worker's estimate from ``worker_bytes``, the largest files counted first), at least one.

    Args:
        sizes_bytes: each file's peak estimate (``worker_bytes``).
        cores: default ``usable_cores()``.
        available_bytes: default (-1) ``available_memory_bytes()``; None: memory is not a limit.
    """
    if not sizes_bytes:
        return 1
    cores = usable_cores() if cores is None else cores
    available = available_memory_bytes() if available_bytes == -1 else available_bytes
    jobs = max(1, min(cores, len(sizes_bytes)))
    if available is not None:
        budget = available * MEMORY_SHARE
        largest = sorted(sizes_bytes, reverse=True)
        while jobs > 1 and sum(largest[:jobs]) > budget:
            jobs -= 1
    return jobs


def capped_jobs(requested: int, files: int, cores: int | None = None) -> int:
    """How many files to read at once when ``requested`` were asked for (``--jobs``): no more than the usable cores
    (more workers only take turns on them, each holding its memory) nor the files, at least one; one warning line
    on the dpprof logger when that is fewer than asked.

    Args:
        requested: the number asked for.
        files: how many files there are to read.
        cores: default ``usable_cores()``.
    """
    cores = usable_cores() if cores is None else cores
    jobs = max(1, min(requested, cores, files))
    if jobs < requested:
        limits = [f"{cores} usable core{'s' if cores != 1 else ''}"] if cores < requested else []
        if files < requested:
            limits.append(f"{files} file{'s' if files != 1 else ''}")
        log.warning("dpprof: --jobs %d capped at %d (%s)", requested, jobs, " and ".join(limits))
    return jobs


def collect_files(paths: Sequence[Path], jobs: int = 1, progress: Callable[[int, int], None] | None = None,
                  start_method: str | None = None) -> list[Collected]:
    """Each file's ``Collected``, in the order given, read ``jobs`` at a time in worker processes (in this
    process for one job or one file).

    Args:
        paths: the trace files.
        jobs: how many files to read at once.
        progress: called with (index of the file in ``paths``, bytes read from disk since the last call).
        start_method: a multiprocessing start method for the workers (default: fork where safe, else spawn).

    Raises:
        TraceError: a file cannot be read (the first to fail; the other workers are stopped).
    """
    if jobs <= 1 or len(paths) <= 1:
        return [collect(TraceFile(p, None if progress is None else _for_file(progress, i)))
                for i, p in enumerate(paths)]
    return _Workers(paths, min(jobs, len(paths)), progress, start_method or _start_method()).run()


def _for_file(progress: Callable[[int, int], None], index: int) -> Callable[[int], None]:
    return lambda n: progress(index, n)


def _start_method() -> str:
    """fork where it is safe and free; a fresh interpreter elsewhere."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return "fork"
    return "spawn"


def _worker(conn: Connection) -> None:
    """A worker process: read each file it is sent, send back what it found, until it is sent None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends its workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker must not keep its parent's handler
    while True:
        task = conn.recv()
        if task is None:
            return
        index, path = task
        try:
            found = collect(TraceFile(path, progress=lambda n: conn.send(("read", index, n))))
        except TraceError as err:
            conn.send(("error", index, str(err)))
        except BaseException:  # a bug, or memory: said as the traceback, raised by the parent
            conn.send(("crash", index, traceback.format_exc()))
        else:
            conn.send(("done", index, found))


class _Workers:
    """Up to ``jobs`` worker processes, each sent the next file (the largest first) as it finishes one."""

    def __init__(self, paths: Sequence[Path], jobs: int, progress: Callable[[int, int], None] | None,
                 start_method: str) -> None:
        self.paths = [Path(p) for p in paths]
        self.jobs = jobs
        self.progress = progress
        # typed as the default context: get_context's BaseContext has no Process in typeshed, every start method's does
        self.context: multiprocessing.context.DefaultContext = multiprocessing.get_context(start_method)  # type: ignore[assignment]
        sizes = [_size(p) for p in self.paths]
        self.queue = sorted(range(len(self.paths)), key=lambda i: -sizes[i])  # the largest first: all end together
        self.busy: dict[Connection, tuple[Any, int | None]] = {}  # connection -> (process, index of its file)

    def run(self) -> list[Collected]:
        results: list[Collected | None] = [None] * len(self.paths)
        try:
            for _ in range(self.jobs):
                ours, theirs = self.context.Pipe()
                process = self.context.Process(target=_worker, args=(theirs,), daemon=True,
                                               name="dpprof-import-worker")
                process.start()
                theirs.close()  # only the worker holds its end: its exit is our end's EOF
                self.busy[ours] = (process, None)
            for conn in list(self.busy):
                self._hand_next(conn)
            while any(index is not None for _, index in self.busy.values()):
                for ready in wait([c for c, (_, i) in self.busy.items() if i is not None]):
                    conn = cast(Connection, ready)  # wait() hands back what it was given: our connections
                    process, index = self.busy[conn]
                    assert index is not None  # only connections handed a file are waited on
                    try:
                        kind, index, payload = conn.recv()
                    except (EOFError, OSError):
                        process.join(1)
                        raise TraceError(f"{self.paths[index].name}: the process reading it ended unexpectedly "
                                         f"(exit code {process.exitcode})") from None
                    if kind == "read":
                        if self.progress is not None:
                            self.progress(index, payload)
                    elif kind == "done":
                        results[index] = payload
                        self._hand_next(conn)
                    elif kind == "error":
                        raise TraceError(payload)
                    else:
                        raise RuntimeError(f"reading {self.paths[index].name} failed in a worker process:\n{payload}")
        except BaseException:
            self._stop(at_once=True)
            raise
        self._stop(at_once=False)
        return results  # type: ignore[return-value]  # every file done

    def _hand_next(self, conn: Connection) -> None:
        process, _ = self.busy[conn]
        if self.queue:
            index = self.queue.pop(0)
            conn.send((index, str(self.paths[index])))
            self.busy[conn] = (process, index)
        else:
            self.busy[conn] = (process, None)

    def _stop(self, at_once: bool) -> None:
        """End every worker: asked to (all files read) or terminated (a file failed, or the caller was
        interrupted); none is left running either way."""
        for conn, (process, _) in self.busy.items():
            if not at_once:
                try:
                    conn.send(None)
                except OSError:
                    pass
            else:
                process.terminate()
        for conn, (process, _) in self.busy.items():
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()
        self.busy.clear()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
