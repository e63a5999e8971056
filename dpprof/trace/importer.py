"""``dpprof import``: torch.profiler traces in, one dpprof run out, written through the store's writer.

Several files of one job are one run with one rank per file, stored the way dpprof's own DDP runs are
(one ``<run id>.rank<N>.sqlite`` per rank), read several at once in worker processes (dpprof.trace.jobs).
Files are checked and converted first, the run is written
under a hidden staging directory in the reports directory (on local disk where that is on a network or
FUSE filesystem: dpprof.store.staging), checked whole, and published only then (dpprof.store.publish), so a bad
file, a full disk or Ctrl-C leaves nothing behind, and a kill leaves a staging directory that the next command
writing there finishes or removes.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from dpprof.outputs import Outputs
from dpprof.records import NoteRecord, StepRecord
from dpprof.store.files import is_capture_trace
from dpprof.store.faults import DISK_FULL, STORAGE_CAUSES, RecordingError, cause_of
from dpprof.store.detail_rows import write_detail
from dpprof.store.model import TRACE_SOURCE
from dpprof.store.ids import new_run_id  # the same ids as recorded runs
from dpprof.store.reader import (FULL_DISK_FREE_BYTES, RUN_SUFFIX, RunFileError, load_run, read_run_file,
                                 why_not_regular)
from dpprof.store.reader import reports_dir as resolve_reports_dir
from dpprof.store.retention import ALL
from dpprof.store.publish import Stage, recover
from dpprof.store.staging import staging_for
from dpprof.store.writer import SqliteSink, replace_findings
from dpprof.trace.collect import Collected
from dpprof.trace.convert import Converted, convert
from dpprof.trace.jobs import capped_jobs, collect_files, default_jobs, task_sizes
from dpprof.trace.decode import TraceError, is_trace_name
from dpprof.trace.readback import exported_identity

__all__ = ["AlreadyImported", "ImportedRun", "import_traces", "trace_files", "imported_traces", "pending_traces",
           "job_name",
           "jobs_for", "SOURCE"]

SOURCE = TRACE_SOURCE  # runs.source of an imported run
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
# Run files written at once: measured on the build machine, four rank files took 1.3-2.2 s one after another
# and 0.2-0.3 s in threads (their time is the disk syncing each new file)
WRITERS = 8

log = logging.getLogger("dpprof")


class AlreadyImported(TraceError):
    """Trace files that runs in the reports directory were imported from already (same name and size)."""

    def __init__(self, runs: dict[str, list[str]], others: list[str]) -> None:
        self.runs = runs  # file name -> ids of the runs imported from it, in order of their ids
        self.others = others  # the files given with them that were not imported yet
        said = []
        for ids in dict.fromkeys(map(tuple, runs.values())):  # files imported as the same run(s) said together
            files = [f for f, of in runs.items() if tuple(of) == ids]
            said.append(f"{', '.join(files)} {'was' if len(files) == 1 else 'were'} imported already as "
                        f"run{'s' if len(ids) > 1 else ''} {', '.join(ids)} (dpprof show {ids[-1]})")
        if others:
            said.append(f"{', '.join(others)} {'was' if len(others) == 1 else 'were'} not")
        many = len(runs) + len(others) > 1
        super().__init__(f"{'; '.join(said)}; --again imports {'them' if many else 'it'} once more")


@dataclass
class ImportedRun:
    id: str
    paths: list[Path]
    steps: int
    devices: list[str]
    notes: list[str] = field(default_factory=list)  # what the rules for steps and impossible numbers did (numbers.py)


def trace_files(sources: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The trace files named, and those directly inside the directories named, in the order given."""
    out: list[Path] = []
    for source in map(Path, sources):
        if source.is_dir():
            # a deep capture's raw trace is left out: its run holds its steps already (store.files.CAPTURE_TRACE)
            found = sorted(p for p in source.iterdir()
                           if p.is_file() and is_trace_name(p.name) and not is_capture_trace(p.name))
            if not found:
                raise TraceError(f"{source}: no .json or .json.gz trace files in this directory{_held_below(source)}")
            out += found
        elif source.is_file():
            out.append(source)
        else:  # say what is there: a FIFO, a device, a dangling symlink, or nothing
            raise TraceError(f"{source}: {why_not_regular(source) or 'no such file or directory'}")
    return out


def _held_below(directory: Path) -> str:
    """Where a directory with no trace files of its own has some one level down (a TensorBoard log directory: one
    directory per run, as tensorboard_trace_handler(dir_name) writes them): "; ..." naming those directories, else ""."""
    def holds_traces(d: Path) -> bool:
        try:
            return d.is_dir() and any(p.is_file() and is_trace_name(p.name) and not is_capture_trace(p.name)
                                      for p in d.iterdir())
        except OSError:  # a directory that cannot be read: not one to name
            return False

    below = sorted(d.name for d in directory.iterdir() if holds_traces(d))
    if not below:
        return ""
    shown = ", ".join(below[:5]) + (f" and {len(below) - 5:,} more" if len(below) > 5 else "")
    return (f"; {'its directory' if len(below) == 1 else 'its directories'} {shown} hold some (a TensorBoard log "
            f"directory, a directory per run): import {'it' if len(below) == 1 else 'one of them'}")


def _abs_offset_us(c: Collected) -> float:
    """What to add to the file's ts to get microseconds since the epoch (ts are relative to
    baseTimeNanoseconds where the trace has one)."""
    base = c.meta.get("baseTimeNanoseconds")  # checked by collect: a whole number of ns, 0 to 2**62
    return float(base) / 1e3 if isinstance(base, (int, float)) else 0.0


def _base_ns(c: Collected) -> int:
    """The file's baseTimeNanoseconds as a whole number (0 without one): differences between files kept exact."""
    base = c.meta.get("baseTimeNanoseconds")
    return int(base) if isinstance(base, (int, float)) else 0


def _ranks(files: list[Collected]) -> list[int | None]:
    """Each file's rank: distributedInfo, else a number in its name (rank3), else its place in the list."""
    if len(files) == 1:
        return [files[0].rank]
    infos = [f.rank for f in files]
    ranks: list[int]
    if all(r is not None for r in infos):
        ranks = [r for r in infos if r is not None]
    elif any(r is not None for r in infos):
        odd = files[infos.index(None)]
        raise TraceError(f"{odd.name}: has no distributedInfo while the other files do: files of two different jobs")
    else:
        named = [_RANK_IN_NAME.search(f.name) for f in files]
        ranks = [int(m.group(1)) for m in named if m] if all(named) else list(range(len(files)))
    seen: dict[int, str] = {}
    for f, r in zip(files, ranks):
        if r in seen:
            raise TraceError(f"{f.name}: rank {r} again (also {seen[r]}): files of two different jobs, or one given twice")
        seen[r] = f.name
    return list(ranks)


def _cycle_advice(cycles: dict[tuple[str, Any], list[str]]) -> str:
    """What to import instead of several profiling cycles given together: each file on its own where they are one
    process's; where several processes (the ranks of a job) each wrote as many cycles, each cycle's files together,
    the k-th file in time of each process (its handler's time stamp), by rank."""
    if len(cycles) < 2 or len({len(names) for names in cycles.values()}) > 1:
        return "import each file on its own"
    by_rank = sorted(cycles, key=lambda key: (key[1] is None, key[1] if key[1] is not None else 0, key[0]))
    in_time = [sorted(cycles[key], key=_handler_time) for key in by_rank]
    return (f"import each cycle's files together, one per {'rank' if by_rank[0][1] is not None else 'process'}: "
            + "; ".join(", ".join(cycle) for cycle in zip(*in_time)))


def _handler_time(name: str) -> int:
    """The time stamp tensorboard_trace_handler put in a file's name (<worker>.<time>.pt.trace.json), 0 without one."""
    match = _HANDLER_NAME.match(name)
    return int(match.group(2)) if match else 0


def _check_one_job(files: list[Collected]) -> None:
    """Files given together must be ranks of one job: each its own trace, same world size and backend, overlapping
    in time."""
    if len(files) < 2:
        return
    traces: dict[tuple[str, Any], str] = {}  # (Kineto's trace_id, the file's rank) -> the file
    for f in files:
        trace_id = f.meta.get("trace_id")
        info = f.meta.get("distributedInfo")
        # the id is new for every trace torch writes; keyed with the rank too, so that ranks given one id by a
        # request that profiled them all (an on-demand trace) are never taken for copies
        if isinstance(trace_id, str) and trace_id:
            identity = (trace_id, info.get("rank") if isinstance(info, dict) else None)
            if identity in traces:
                raise TraceError(f"{f.name}: the same trace as {traces[identity]} (trace_id {trace_id}): one trace "
                                 "given twice, not two ranks of a job")
            traces[identity] = f.name
    cycles: dict[tuple[str, Any], list[str]] = {}  # tensorboard_trace_handler's <host>_<pid>, and rank -> its files
    for f in files:
        handled = _HANDLER_NAME.match(f.name)
        if handled is not None:
            cycles.setdefault((handled.group(1), f.rank), []).append(f.name)
    for (worker, _), names in cycles.items():
        if len(names) > 1:
            raise TraceError(f"{', '.join(sorted(names))}: {len(names)} profiling cycles of one process ({worker}, "
                             "tensorboard_trace_handler's files of a schedule with repeat): not ranks of a job; "
                             f"{_cycle_advice(cycles)}")
    first = files[0]
    info0 = first.meta.get("distributedInfo") or {}  # an object, checked by collect (dpprof.trace.numbers)
    for f in files[1:]:
        info = f.meta.get("distributedInfo") or {}
        for key in ("world_size", "backend"):
            if info0.get(key) != info.get(key):
                raise TraceError(f"{f.name}: {key} {info.get(key)!r} but {first.name} has {info0.get(key)!r}: "
                                 "files of two different jobs")
    spans = [(f.first_us + _abs_offset_us(f), f.last_us + _abs_offset_us(f), f) for f in files]
    for lo, hi, f in spans:
        others = [(a, b) for a, b, g in spans if g is not f]
        if all(hi < a or lo > b for a, b in others):
            when = datetime.fromtimestamp(lo / 1e6, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            raise TraceError(f"{f.name}: recorded at {when} UTC, at no time the other files were: files of two "
                             "different jobs")


# What a trace file's name carries besides its job: the extensions torch.profiler writes, the rank of one file of
# several ("-rank3", "_rank_3", ".rank3"), and the "<host>_<pid>.<ms since 1970>" torch.profiler's
# tensorboard_trace_handler names each worker's file with (the pid and time differ between the ranks of one job), or
# "<worker_name>.<time>" where the script names its workers (worker_name=f"rank{rank}").
_TRACE_EXTENSIONS = re.compile(r"(\.pt)?(\.trace)?\.json(\.gz)?$", re.IGNORECASE)
_RANK_TOKEN = re.compile(r"[-_.]?rank[-_.]?\d+(?=$|[-_.])", re.IGNORECASE)
_HANDLER_SUFFIX = re.compile(r"(_\d+)?\.\d{10,}$")  # [_<pid>].<epoch ms or ns>: a worker_name given has no pid
# tensorboard_trace_handler's file: <worker name, by default host_pid>.<epoch ms or ns>.pt.trace.json
_HANDLER_NAME = re.compile(r"^(.+)\.(\d{10,})(\.pt)?\.trace\.json(\.gz)?$")
LEGACY_WORKLOAD = "torch.profiler trace"  # every imported run's workload before job_name (and a nameless file's)


def job_name(names: Sequence[str]) -> str:
    """The workload of an imported run: the job its files are of, from their names, the same for every rank's
    file of one job ("ddp-2ranks-rank0-nccl.json.gz" -> "ddp-2ranks-nccl"; "host_123.1700000000000.pt.trace.json"
    -> "host"), so that runs of one job are the same workload and unrelated traces are not.

    Example:
        >>> job_name(["resnet-rank0.pt.trace.json.gz", "resnet-rank1.pt.trace.json.gz"])
        'resnet'
    """
    stems = []
    for name in names:
        stem = _TRACE_EXTENSIONS.sub("", Path(str(name)).name)
        stem = _HANDLER_SUFFIX.sub("", stem)
        stems.append(_RANK_TOKEN.sub("", stem).strip("-_. "))
    common = os.path.commonprefix(stems).rstrip("-_. ") if len(set(stems)) > 1 else stems[0] if stems else ""
    return common or LEGACY_WORKLOAD


def _created_at(c: Collected, first_us: float) -> str:
    abs_us = first_us + _abs_offset_us(c)
    if abs_us > 1e15:  # an epoch time (µs since 1970 past 2001): when the trace was recorded
        return datetime.fromtimestamp(abs_us / 1e6, timezone.utc).isoformat()
    return datetime.now(timezone.utc).isoformat()


def import_traces(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], reports_dir: str | os.PathLike[str] | None = None,
                  name: str | None = None, progress: Callable[[int], None] | None = None,
                  again: bool = False, jobs: int | None = None,
                  file_progress: Callable[[Path, int], None] | None = None) -> ImportedRun:
    """Read torch.profiler traces and write them as one dpprof run into the reports directory.

    Args:
        sources: trace files (``.json``, ``.json.gz``) or directories of them; several files are the
            ranks of one job. One path alone (a str or a Path) is one source, not a sequence of characters.
        reports_dir: where the run goes (default: $DPPROF_REPORTS, else ./reports).
        name: the run's name (default: for files ``dpprof export`` wrote, the name of the run they hold; else the
            first file's name).
        progress: called with bytes read from disk as the files are read (for a progress bar).
        again: import files that a run in the reports directory was imported from already.
        jobs: how many files to read at once, each in a process of its own (default: ``jobs_for(paths)``:
            one per core, fewer where memory would not hold them; 1 reads them one after another here).
        file_progress: called with (file, bytes read from it since the last call), for a bar per file.

    Returns:
        the new run's id, files, step count and devices.

    Raises:
        AlreadyImported: without ``again``, a run in the reports directory was imported from one of the
            files (same name and size); nothing is read or written.
        TraceError: a file is missing, not a trace, truncated, empty, or the files are of different jobs
            (nothing is written); or the reports directory is on a network filesystem and the local staging
            directory cannot be used.

    Example:
        >>> run = import_traces(["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"], name="baseline")
        >>> dpprof.load_run(run.id).comms
    """
    # a str is a Sequence of str: one path given alone would read as a file per character ("r: no such file")
    paths = trace_files([sources] if isinstance(sources, (str, os.PathLike)) else sources)
    if not paths:
        raise TraceError("no trace files given")
    directory = resolve_reports_dir(reports_dir)
    if directory.is_dir():
        recover(directory)  # what an import or merge killed here left: published whole, or removed
    if not again:
        imported = imported_traces(reports_dir)
        runs = {p.name: imported[key] for p in paths if (key := (p.name, p.stat().st_size)) in imported}
        if runs:
            raise AlreadyImported(runs, [p.name for p in paths if p.name not in runs])
    jobs = jobs_for(paths) if jobs is None else capped_jobs(jobs, len(task_sizes(paths, jobs)))

    def read(index: int, nbytes: int) -> None:
        if progress is not None:
            progress(nbytes)
        if file_progress is not None:
            file_progress(paths[index], nbytes)

    files = collect_files(paths, jobs, read if progress is not None or file_progress is not None else None)
    _check_one_job(files)
    ranks = _ranks(files)
    distributed = len(files) > 1 or ranks[0] is not None
    order = sorted(range(len(files)), key=lambda i: (ranks[i] is None, ranks[i] if ranks[i] is not None else i))
    files, ranks = [files[i] for i in order], [ranks[i] for i in order]
    starts = [(min([s[1] for s in f.steps] or [f.first_us]), f) for f in files]
    first_us, first = min(starts, key=lambda sf: sf[0] + _abs_offset_us(sf[1]))
    t0_abs = first_us + _abs_offset_us(first)
    # each file's origin in its own ts: the first file's is its first start exactly (never t0_abs less its offset,
    # ~1.8e15 us, where a float keeps a quarter of a microsecond: its first step began at -0.06 us, and the
    # run's exported trace was refused), the others' its start plus the whole nanoseconds between the bases
    converted: list[Converted] = [convert(f, first_us + (_base_ns(first) - _base_ns(f)) / 1e3, r if distributed else None)
                                  for f, r in zip(files, ranks)]
    if not any(any(isinstance(x, StepRecord) for x in c.records) for c in converted):
        gpu_only = any(f.gpu for f in files)
        raise TraceError(f"{files[0].name}: no CPU ranges to make steps of ("
                         + ("a trace with GPU activity only)" if gpu_only else "no operator or range with a time)"))
    own = exported_identity(files[0].meta)  # dpprof's own files: the run they hold
    run_id = new_run_id()
    # the run files whole or none (dpprof.store.publish: built in a staging directory, published once whole; a kill
    # leaves the directory for the next command to finish or remove); the reports directory, if this made it, goes
    # again with nothing in it; an OSError (read-only, full, ...) is one OutputError line naming the directory
    with Outputs() as out:
        out.directory(directory)
        try:
            local = staging_for(directory)  # a network or FUSE filesystem: the run is written on local disk first
        except RecordingError as err:  # it must be and cannot be: one line, as for a bad file
            raise TraceError(str(err)) from None
        with Stage(directory, f".import-{run_id}", local.directory if local is not None else None) as stage:
            if local is not None:
                log.warning("dpprof: %s: writing the run in %s on local disk and moving it into %s whole",
                            local.why(), stage.path, directory)
            written = _write(stage.path, run_id, name or own.get("name") or files[0].name,
                             own["workload"] if "workload" in own else job_name([f.name for f in files]), files,
                             ranks if distributed else [None], converted, t0_abs, distributed)
            _store_findings(written)
            for path in written:
                if (directory / path.name).exists():
                    raise TraceError(f"{directory / path.name}: already exists; nothing was imported")
            # the other ranks first, the run's first file (whose row the listing shows) last
            published = stage.publish([*written[1:], written[0]])
    final = [*published[-1:], *published[:-1]]
    devices = [d for c in converted for d in c.devices]
    steps = max(sum(1 for x in c.records if isinstance(x, StepRecord)) for c in converted)
    # what the import left out is said as it happens: the file's notes, and its tables' (values that cannot be);
    # the converted notes hold the file's own again (its left-out events), said once
    notes = [f"{f.name}: {note}" for f, c in zip(files, converted)
             for note in dict.fromkeys([*f.notes, *(n for n in c.notes if " left out" in n)])]
    return ImportedRun(id=run_id, paths=final, steps=steps, devices=devices, notes=notes)


def _write(staging: Path, run_id: str, name: str, workload: str | None, files: list[Collected], ranks: list[int | None],
           converted: list[Converted], t0_abs: float, distributed: bool) -> list[Path]:
    """One run file per trace file in ``staging``, several at once: threads, whatever ``jobs`` is, as a new run
    file's cost is mostly waiting for the disk to sync it, which sqlite does without the GIL."""
    listing = [{"file": f.name, "bytes": f.size_bytes, "events": f.events} for f in files]
    world = None
    if distributed:
        # without distributedInfo, the files given are the job only where their ranks are 0 to n-1: files named
        # job-rank2 and job-rank10 are two ranks of a job of unknown size, not a 2-rank job
        world = files[0].world_size or (len(files) if sorted(r or 0 for r in ranks) == list(range(len(files))) else None)
    # torch's DataParallel.forward driving GPUs ("torch"), or dpprof's ranges ("exact")
    dataparallel = next((c.dataparallel for c in converted if c.dataparallel), None)
    fsdp = any(c.fsdp for c in converted)  # a job sharded with FSDP: its ranges are in the trace
    ddp_buckets = any(c.ddp_buckets for c in converted)  # a DDP run dpprof exported: its gradient buckets
    exported = all(c.exported for c in converted)  # read back from dpprof's export: no operators in the files
    paths = [staging / f"{run_id}{f'.rank{rank}' if distributed else ''}{RUN_SUFFIX}"
             for rank in (ranks if distributed else [None])]

    def write(i: int) -> None:
        f, rank, conv, path = files[i], (ranks[i] if distributed else None), converted[i], paths[i]
        row: dict[str, Any] = {
            "id": run_id, "name": name, "created_at": _created_at(f, t0_abs - _abs_offset_us(f)),
            "host": f.meta.get("host_name") if isinstance(f.meta.get("host_name"), str) else None,  # else unknown
            "pid": None, "torch_version": None, "cuda_version": None,
            "backend": "cuda" if f.gpus or conv.gpus else "cpu", "devices": conv.devices, "workload": workload,
            "workload_args": {"trace_files": listing, "trace_file": f.name,
                              "distributedInfo": f.meta.get("distributedInfo"), "dataparallel": dataparallel,
                              **({"fsdp": True} if fsdp else {}), **({"ddp_buckets": True} if ddp_buckets else {}),
                              **({"dpprof_export": True} if exported else {}),
                              **({"data_loaders": conv.data_loaders} if conv.data_loaders is not None else {})},
            "status": "finished", "error": None, "rank": rank, "world_size": world, "source": SOURCE,
        }
        steps = [x for x in conv.records if isinstance(x, StepRecord)]
        if steps:
            end_ms = max(s.start_ms + s.duration_ms for s in steps)
            start = datetime.fromisoformat(row["created_at"])
            row["ended_at"] = (start + timedelta(milliseconds=end_ms)).isoformat()  # times bounded: numbers.py
        sink = SqliteSink(str(path), row, max_buffered=len(conv.records) + len(conv.notes) + 16,
                          retention=ALL)  # a trace is as long as its profiler schedule made it: keep it whole
        try:
            for record in conv.records:
                sink.put(record)
            for message in conv.notes:
                sink.put(NoteRecord(t_ms=0.0, source="trace", message=f"{f.name}: {message}"))
        finally:
            sink.close()
        _check_written(f.name, path, sink, len(steps))
        if conv.detail is not None:  # operators, kernels, GPU metrics, memory, modules (dpprof.trace.detail)
            try:
                write_detail(path, conv.detail)
            except (sqlite3.Error, OSError) as err:  # a full disk, say: one line naming the directory, exit 1
                cause = cause_of(err, path)
                raise RecordingError(cause, str(path.parent), cause) from None

    if len(files) == 1:
        write(0)
    else:
        with ThreadPoolExecutor(max_workers=min(WRITERS, len(files)), thread_name_prefix="dpprof-import-write") as pool:
            for done in [pool.submit(write, i) for i in range(len(files))]:
                done.result()  # the first failure, in file order, once all have ended
    return paths


def _check_written(source: str, path: Path, sink: SqliteSink, steps: int) -> None:
    """Raise unless the run file at ``path`` is whole: every record stored, its log folded back into it, and, read
    back, finished with every step. A full disk is a RecordingError (one line naming the directory, exit 1),
    a value SQLite cannot store (a number past 64 bits) a TraceError naming the trace file."""
    staging = str(path.parent)
    if sink.failure is not None:
        if sink.disk_full or sink.failure in STORAGE_CAUSES:  # a full disk, say: the outputs say where and why
            raise RecordingError(sink.message or sink.failure, staging, sink.failure)
        raise TraceError(f"{source}: a value could not be stored ({sink.failure}); nothing was imported")
    if sink.dropped:
        raise TraceError(f"{source}: {sink.dropped} records could not be written; nothing was imported")
    if not sink.folded:  # the file alone is not the whole run: its write-ahead log could not be folded back
        full = shutil.disk_usage(staging).free < FULL_DISK_FREE_BYTES
        cause = DISK_FULL if full else "its write-ahead log could not be folded back into the run file"
        raise RecordingError(cause, staging, cause)
    try:
        meta, summary = read_run_file(path)
    except RunFileError as err:
        raise RecordingError(f"{path.name}: {err}", staging, str(err)) from None
    if meta["status"] != "finished" or summary["steps"] != steps:
        cause = DISK_FULL if meta["status"] == "disk_full" else (
            f"the run file reads {meta['status']} with {summary['steps']} of {steps} steps")
        raise RecordingError(cause, staging, cause)


def _store_findings(written: list[Path]) -> None:
    """The findings of the imported run's kind (dpprof.findings), stored in its first file."""
    from dpprof.findings import FINDING_COLUMNS, run_findings

    try:
        found = run_findings(load_run(written[0]), fresh=True).table
        rows = [tuple(None if pd.isna(v) else v for v in row)
                for row in found[FINDING_COLUMNS].itertuples(index=False)]
        replace_findings(str(written[0]), rows)
    except (sqlite3.Error, OSError) as err:  # a full disk as the findings are stored: one line, exit 1
        cause = cause_of(err, written[0])
        raise RecordingError(cause, str(written[0].parent), cause) from None


def jobs_for(paths: Sequence[str | os.PathLike[str]]) -> int:
    """The default number of files (or parts of a large plain JSON file) to read at once: one per core, fewer where
    memory would not hold them (dpprof.trace.jobs.default_jobs, task_sizes)."""
    return default_jobs(task_sizes(paths))


def imported_traces(reports_dir: str | os.PathLike[str] | None = None) -> dict[tuple[str, int], list[str]]:
    """The trace files the runs in the reports directory were imported from: (file name, size in bytes) ->
    the ids of those runs, sorted (an id begins with the time it was made, to the second)."""
    from dpprof.store.reader import list_runs

    directory = resolve_reports_dir(reports_dir)
    if not directory.is_dir():
        return {}
    runs = list_runs(directory)
    imported: dict[tuple[str, int], list[str]] = {}
    trace_runs = runs[runs["reason"].isna() & (runs["source"] == SOURCE)]
    for run_id, path in sorted(zip(trace_runs["id"], trace_runs["path"])):
        try:
            listing = load_run(path).meta["workload_args"].get("trace_files") or []
        except Exception:  # a run file that went or broke since listing: it imported nothing we can see
            continue
        for f in listing:
            imported.setdefault((f.get("file"), f.get("bytes")), []).append(run_id)
    return imported


def pending_traces(reports_dir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """Trace files in the reports directory that no run there was imported from (same name and size).

    Returns:
        columns file, size_bytes, modified (UTC, ISO), oldest first.
    """
    directory = resolve_reports_dir(reports_dir)
    cols = ["file", "size_bytes", "modified"]
    if not directory.is_dir():
        return pd.DataFrame(columns=cols)
    files = [p for p in directory.iterdir() if p.is_file() and is_trace_name(p.name) and not p.name.startswith(".")
             and not is_capture_trace(p.name)]  # a deep capture's raw trace: its run holds its steps already
    if not files:
        return pd.DataFrame(columns=cols)
    imported = imported_traces(directory)
    rows = []
    for p in files:
        stat = p.stat()
        if (p.name, stat.st_size) not in imported:
            rows.append({"file": p.name, "size_bytes": stat.st_size,
                         "modified": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat()})
    return pd.DataFrame(rows, columns=cols).sort_values("modified", kind="stable").reset_index(drop=True)
