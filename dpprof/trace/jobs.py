"""The files of one job read in separate processes (``dpprof import --jobs N``), and how many at once.

Each worker process reads and collects whole files (``dpprof.trace.collect``: the heavy part, decoding
every event) and hands back the ``Collected`` of each, a few MB of ranges and typed arrays; checking the
files against each other, converting and writing the run stay with the caller, as with one process. A
file that cannot be read stops the others at once, and its error is raised as it would be read alone.

With fewer files than workers, a plain JSON file of ``SPLIT_MIN_BYTES`` or more is read in parts, one per worker
(``dpprof.trace.decode.split_points``: cut at event boundaries a JSON string cannot hold), and the parts' results
are merged into the file's (``collect.merge_parts``), table for table what one pass makes. A part that fails, or
whose results cannot be merged as they are (an event left out after the first part, whose message would number it
from the part's start), has its file read again whole in this process, which raises or words its problems as
reading it alone does. A cut in the wrong place (between objects nested in an event, were a trace to hold some that
look like events) leaves the part before it ending inside an event, which cannot be read: that file too is read
whole.

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

from dpprof.trace.collect import Collected, collect, collect_part, finish, merge_parts
from dpprof.trace.decode import Span, TraceError, TraceFile, is_gzip_name, split_points

__all__ = ["default_jobs", "capped_jobs", "collect_files", "usable_cores", "available_memory_bytes", "worker_bytes",
           "task_sizes", "SPLIT_MIN_BYTES"]

# A plain JSON file at least this large is read in parts when there are fewer files than workers: below it, starting
# a worker and merging cost more than the part saves.
SPLIT_MIN_BYTES = 64 << 20

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
    json_bytes = size * GZIP_RATIO if is_gzip_name(path.name) else size
    return WORKER_BASE_BYTES + int(json_bytes * COLLECTED_PER_JSON_BYTE)


def _splittable(path: Path, min_bytes: int) -> bool:
    return not is_gzip_name(path.name) and _size(path) >= min_bytes


def _parts_each(paths: Sequence[Path], jobs: int) -> int:
    """Parts of each splittable file: the workers shared among the files (one part each where there are more files)."""
    return max(1, jobs // max(1, len(paths)))


def task_sizes(paths: Sequence[str | os.PathLike[str]], jobs: int | None = None,
               min_bytes: int | None = None) -> list[int]:
    """Each thing a worker would read, as ``worker_bytes`` estimates it: a file, or each part of a plain JSON file of
    ``min_bytes`` (default ``SPLIT_MIN_BYTES``) or more where there are fewer files than ``jobs`` (default: the usable
    cores)."""
    min_bytes = SPLIT_MIN_BYTES if min_bytes is None else min_bytes
    files = [Path(p) for p in paths]
    each = _parts_each(files, usable_cores() if jobs is None else jobs)
    out: list[int] = []
    for p in files:
        if each > 1 and _splittable(p, min_bytes):
            out += [WORKER_BASE_BYTES + int(_size(p) / each * COLLECTED_PER_JSON_BYTE)] * each
        else:
            out.append(worker_bytes(p))
    return out


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
                  start_method: str | None = None, split_min_bytes: int | None = None) -> list[Collected]:
    """Each file's ``Collected``, in the order given, read ``jobs`` at a time in worker processes (in this
    process for one job, or one file that is not read in parts).

    Args:
        paths: the trace files.
        jobs: how many files (or parts of files) to read at once.
        progress: called with (index of the file in ``paths``, bytes read from disk since the last call).
        start_method: a multiprocessing start method for the workers (default: fork where safe, else spawn).
        split_min_bytes: the smallest plain JSON file read in parts where there are fewer files than ``jobs``
            (default ``SPLIT_MIN_BYTES``).

    Raises:
        TraceError: a file cannot be read (the first to fail; the other workers are stopped).
    """
    paths = [Path(p) for p in paths]
    each = _parts_each(paths, jobs) if jobs > 1 else 1
    min_bytes = SPLIT_MIN_BYTES if split_min_bytes is None else split_min_bytes
    tasks = [(i, span) for i, p in enumerate(paths) for span in _spans(p, each, min_bytes)]
    if jobs <= 1 or len(tasks) <= 1:
        return [collect(TraceFile(p, None if progress is None else _for_file(progress, i)))
                for i, p in enumerate(paths)]
    found = _Workers(paths, tasks, min(jobs, len(tasks)), progress, start_method or _start_method()).run()
    out: list[Collected] = []
    for i, p in enumerate(paths):
        parts = found[i]
        if len(parts) == 1 and parts[0] is not None:  # read whole (and finished) by its worker
            out.append(parts[0])
            continue
        merged = None if any(part is None for part in parts) else merge_parts(parts)  # type: ignore[arg-type]
        # a part failed, or cannot be merged as it is: the file read whole, here (which raises or words it)
        out.append(collect(TraceFile(p)) if merged is None else finish(merged))
    return out


def _spans(path: Path, parts: int, min_bytes: int) -> list[Span | None]:
    """The parts a worker each reads of a file: ``[None]`` (the file whole) unless it is a plain JSON file of
    ``min_bytes`` or more and ``parts`` is 2 or more, and cut points are found."""
    if parts > 1 and _splittable(path, min_bytes):
        try:
            spans = split_points(path, parts)
        except OSError:  # unreadable: the worker reading it whole says so as one pass does
            return [None]
        if len(spans) > 1:
            return list(spans)
    return [None]


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
        index, path, span = task
        try:
            trace = TraceFile(path, progress=lambda n: conn.send(("read", index, n)), span=span)
            found = collect(trace) if span is None else collect_part(trace)
        except TraceError as err:
            conn.send(("error", index, str(err)))
        except BaseException:  # a bug, or memory: said as the traceback, raised by the parent
            conn.send(("crash", index, traceback.format_exc()))
        else:
            # the operator, launch and kernel arrays (most of what was collected) a column at a time, each dropped
            # once sent: a send pickles what it sends whole, and all of them at once would be held twice here
            columns = found.detail.arrays
            while columns:
                name, values = columns.popitem()
                conn.send(("column", index, (name, values)))
                del values
            conn.send(("done", index, found))


class _Workers:
    """Up to ``jobs`` worker processes, each sent the next task (a file, or a part of one; the largest first) as it
    finishes one."""

    def __init__(self, paths: Sequence[Path], tasks: Sequence[tuple[int, Span | None]], jobs: int,
                 progress: Callable[[int, int], None] | None, start_method: str) -> None:
        self.paths = [Path(p) for p in paths]
        self.tasks = list(tasks)
        self.jobs = jobs
        self.progress = progress
        # typed as the default context: get_context's BaseContext has no Process in typeshed, every start method's does
        self.context: multiprocessing.context.DefaultContext = multiprocessing.get_context(start_method)  # type: ignore[assignment]
        sizes = [_task_size(self.paths[i], span) for i, span in self.tasks]
        self.queue = sorted(range(len(self.tasks)), key=lambda t: -sizes[t])  # the largest first: all end together
        self.busy: dict[Connection, tuple[Any, int | None]] = {}  # connection -> (process, index of its task)

    def run(self) -> list[list[Collected | None]]:
        """Each file's results, a part each in file order (one for a file read whole); None for a part that failed
        (its file is read again whole by the caller)."""
        results: list[Collected | None] = [None] * len(self.tasks)
        columns: dict[int, dict[str, Any]] = {}  # task -> the detail arrays its worker sent ahead of its result
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
                    process, task = self.busy[conn]
                    assert task is not None  # only connections handed a task are waited on
                    file, span = self.tasks[task]
                    name = self.paths[file].name
                    try:
                        kind, _, payload = conn.recv()
                    except (EOFError, OSError):
                        process.join(1)
                        raise TraceError(f"{name}: the process reading it ended unexpectedly "
                                         f"(exit code {process.exitcode})") from None
                    if kind == "read":
                        if self.progress is not None:
                            self.progress(file, payload)
                    elif kind == "column":
                        name_of_column, values = payload
                        columns.setdefault(task, {})[name_of_column] = values
                    elif kind == "done":
                        payload.detail.arrays = columns.pop(task, {})
                        results[task] = payload
                        self._hand_next(conn)
                    elif kind == "error" and span is not None:  # a part: its file is read again whole by the caller
                        self._hand_next(conn)
                    elif kind == "error":
                        raise TraceError(payload)
                    else:
                        raise RuntimeError(f"reading {name} failed in a worker process:\n{payload}")
        except BaseException:
            self._stop(at_once=True)
            raise
        self._stop(at_once=False)
        return [[results[t] for t, (i, _) in enumerate(self.tasks) if i == file] for file in range(len(self.paths))]

    def _hand_next(self, conn: Connection) -> None:
        process, _ = self.busy[conn]
        if self.queue:
            task = self.queue.pop(0)
            file, span = self.tasks[task]
            conn.send((file, str(self.paths[file]), span))
            self.busy[conn] = (process, task)
        else:  # nothing left for it: it ends now, its memory freed while the others still read
            try:
                conn.send(None)
            except OSError:
                pass
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


def _task_size(path: Path, span: Span | None) -> int:
    if span is None:
        return _size(path)
    return (span.stop if span.stop is not None else _size(path)) - span.start


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
