"""A run's operators, kernels, GPU metrics, memory over time and modules (dpprof.trace.detail): written into a run
file, and read back as named reads returning DataFrames with a ``rank`` column, units in the column names.

``write_detail`` adds the tables to a run file (an imported trace's, or a recorded run's deep capture: the file may
be open by the run's writer, whose write-ahead log lets both write). A run file without them (imported before dpprof
kept operators, recorded without a capture, or read back from a trace dpprof exported) reads as no data, with the
reason: ``detail_missing``.
"""
from __future__ import annotations

import math
import os
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pandas as pd

from dpprof.store.schema import CAPTURE_COLUMN, DETAIL_TABLES, detail_ddl
from dpprof.store.validation import MAX_VALUE
from dpprof.units import steps_words

if TYPE_CHECKING:
    from dpprof.store.reader import StoredRun

__all__ = ["DetailTables", "Capture", "write_detail", "captures", "read_captures", "chosen_capture", "detail_step_count", "detail_steps_of",
           "detail_missing", "detail_devices", "operators", "kernels", "gpu_metrics", "gpu_summary",
           "memory_timeline", "memory_peaks", "memory_events", "operator_memory", "modules", "stream_spans",
           "detail_notes",
           "WRITE_TIMEOUT_S", "TABLE_OF_FRAME"]

WRITE_TIMEOUT_S = 30.0  # a live run's writer commits every 0.5 s: the detail waits for its turn, never fails for it
# Detail.frames() name -> the run file's table
TABLE_OF_FRAME = {"operators": "operators", "operators_by_shape": "operator_shapes", "kernels": "kernels",
                  "kernels_by_op": "kernel_ops", "gpu_metrics": "gpu_metrics", "memory_timeline": "memory_timeline",
                  "memory_peaks": "memory_peaks", "memory_events": "memory_events",
                  "operator_memory": "operator_memory", "modules": "modules", "stream_spans": "stream_spans"}
_BOOLEAN = {"tc_eligible", "tensor_cores", "cumulative"}


class DetailTables(Protocol):
    """What ``write_detail`` stores: ``dpprof.trace.detail.Detail``."""

    notes: list[str]

    def frames(self) -> dict[str, pd.DataFrame]: ...


def _value(v: Any) -> Any:
    """A cell as SQLite stores it: NaN, NA and None as NULL, numpy numbers as Python's."""
    if v is None or v is pd.NA:
        return None
    if isinstance(v, float):
        return None if math.isnan(v) else v
    if hasattr(v, "item"):
        v = v.item()
        return None if isinstance(v, float) and math.isnan(v) else v
    return v


@dataclass(frozen=True)
class Capture:
    """One deep capture a run keeps the tables of: steps ``first_step`` to ``end_step - 1``, and its raw traces
    (file names in the reports directory, one per rank file that holds it)."""

    first_step: int
    end_step: int
    traces: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return steps_words(self.first_step, self.end_step)


def write_detail(run_path: str | os.PathLike[str], detail: DetailTables, capture: Capture | None = None) -> None:
    """Store a trace's operator, kernel, GPU-metric, memory and module tables in an existing run file (one rank's
    file), in one transaction: a failure leaves the file as it was.

    Args:
        run_path: the run file (``<id>.sqlite``, or one rank's ``<id>.rank<N>.sqlite``).
        detail: ``dpprof.trace.detail.detail_of_trace(...)`` or an import's ``Converted.detail``.
        capture: the deep capture the tables are of: the file keeps every capture's tables, and one of the same
            first step replaces its own (and tables written before captures were kept apart). None (an imported
            trace): the tables replace whatever the file held.

    Raises:
        sqlite3.Error, OSError: the file cannot be written (a full disk, say); nothing was changed.

    Example:
        >>> write_detail(run.path, detail_of_trace("capture.pt.trace.json", {tid: "cpu:0"}))
    """
    frames = detail.frames()
    first = None if capture is None else int(capture.first_step)
    con = sqlite3.connect(str(run_path), timeout=WRITE_TIMEOUT_S)
    try:
        with con:
            for statement in detail_ddl():
                con.execute(statement)
            for table in DETAIL_TABLES:  # a file whose tables were made before captures were kept apart
                if CAPTURE_COLUMN not in {row[1] for row in con.execute(f"PRAGMA table_info({table})")}:
                    con.execute(f"ALTER TABLE {table} ADD COLUMN {CAPTURE_COLUMN} INTEGER")
                if first is None:
                    con.execute(f"DELETE FROM {table}")
                else:
                    con.execute(f"DELETE FROM {table} WHERE {CAPTURE_COLUMN} IS NULL OR {CAPTURE_COLUMN} = ?",
                                (first,))
            if capture is None:
                con.execute("DELETE FROM captures")
            else:
                con.execute("INSERT OR REPLACE INTO captures (first_step, end_step, trace) VALUES (?, ?, ?)",
                            (first, int(capture.end_step), capture.traces[0] if capture.traces else None))
            for frame_name, table in TABLE_OF_FRAME.items():
                columns = list(DETAIL_TABLES[table])
                df = frames[frame_name]
                if not len(df):
                    continue
                rows = [(*(_value(v) for v in row), first)
                        for row in df[columns].itertuples(index=False, name=None)]
                marks = ", ".join("?" * (len(columns) + 1))
                con.executemany(f"INSERT INTO {table} ({', '.join(columns)}, {CAPTURE_COLUMN}) VALUES ({marks})",
                                rows)
            con.executemany(f"INSERT INTO detail_notes (message, {CAPTURE_COLUMN}) VALUES (?, ?)",
                            [(n, first) for n in detail.notes])
    finally:
        con.close()


def captures(run: StoredRun) -> list[Capture]:
    """The deep captures whose tables the run keeps, by first step; [] for an imported trace's run, a run with no
    capture, or a file written before captures were kept apart (its tables read as one capture). Read once per
    StoredRun (``StoredRun.captures``)."""
    return run.captures()


def read_captures(run: StoredRun) -> list[Capture]:
    """``captures`` read from the run's files."""
    have = run.query("SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'captures'")["n"]
    if not len(have) or not (have > 0).all():
        return []
    df = run.query("SELECT first_step, end_step, trace FROM captures ORDER BY first_step")
    out: dict[int, Capture] = {}
    for first, end, trace in df[["first_step", "end_step", "trace"]].itertuples(index=False, name=None):
        if not (_whole(first) and _whole(end) and end > first):  # a damaged row: not a capture to offer
            continue
        known = out.get(int(first))
        traces = (*(known.traces if known else ()), *([str(trace)] if isinstance(trace, str) else []))
        out[int(first)] = Capture(int(first), int(end), traces)
    return [out[k] for k in sorted(out)]


def _whole(v: Any) -> bool:
    """A step index as a damaged file may hold it: a finite whole number from 0 up to MAX_VALUE."""
    return bool(isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(v) and v == int(v)
                and 0 <= v <= MAX_VALUE)


def detail_step_count(run: StoredRun) -> int:
    """How many steps the operator tables read span: the chosen deep capture's (chosen_capture), else, for a run that
    keeps them as one (an imported trace), the run's."""
    chosen = chosen_capture(run)
    return int(chosen.end_step - chosen.first_step) if chosen is not None else int(run.model.steps)


def detail_steps_of(run: StoredRun) -> dict[int, int]:
    """Rank -> how many steps its operator tables span: the chosen capture's (or the run's) for every rank, except in
    a run that keeps its tables as one whose ranks hold different step counts (an imported job whose rank's profiler
    stopped early, or ran another schedule): each rank's own. A one-file run's tables are rank 0's."""
    steps = detail_step_count(run)
    ranks = run.model.ranks or (0,)
    if chosen_capture(run) is not None or len(ranks) < 2:
        return {int(r): steps for r in ranks}
    held = run.table("steps").groupby("rank")["step"].nunique()
    return {int(r): int(held[r]) if r in held.index else steps for r in ranks}


def chosen_capture(run: StoredRun) -> Capture | None:
    """The capture the run's tables are read from: ``run.capture``'s, else the latest; None where the run keeps its
    tables as one (an imported trace, or a file written before captures were kept apart).

    Raises:
        ValueError: ``run.capture`` is no capture of the run (the message lists those it has).
    """
    listed = captures(run)
    if not listed:
        if run.capture is not None:
            raise ValueError(f"run {run.id} has no deep captures kept apart: --capture applies to a recorded run's "
                             "captures")
        return None
    if run.capture is None:
        return listed[-1]
    for c in listed:
        if c.first_step == run.capture:
            return c
    raise ValueError(f"run {run.id} has no capture starting at step {run.capture}: its captures start at step"
                     f"{'s' if len(listed) > 1 else ''} {', '.join(str(c.first_step) for c in listed)}")


def detail_missing(run: StoredRun) -> str | None:
    """Why the run has no operator data (one sentence), or None where every file of it has the tables."""
    if (run.meta.get("workload_args") or {}).get("dpprof_export"):  # its files' tables are there, and empty
        return ("no operator data: this run was read back from a trace dpprof exported, which holds its steps, "
                "phases and collectives, not torch.profiler's operators, kernels or memory events (the run it was "
                "exported from has them)")
    have = run.query("SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'operators'")["n"]
    if len(have) and (have > 0).all():
        return None
    if run.meta.get("source") == "trace":
        return ("no operator data: this run was imported before dpprof kept operators, kernels and memory events "
                "(import its trace files again: dpprof import --again FILE)")
    said = run.notes.loc[run.notes["source"] == "capture", "message"] if "source" in run.notes else ()
    if len(said):  # the run asked for a capture that stored nothing: what its note says, not to ask for one
        return f"no operator data: {'; '.join(dict.fromkeys(said))}"
    return ("no operator data: a recorded run holds operators only from a deep capture with torch.profiler "
            "(dpprof profile ... --capture A:B)")


DEVICE_TABLES = ("operators", "kernels", "memory_timeline")  # every device a detail read can be asked for is in one


def detail_devices(run: StoredRun, rank: int | None = None) -> list[str]:
    """The devices the operator, kernel and memory tables name (of the capture they are read from; of ``rank`` only),
    sorted: what a read's ``device`` can pick; [] for a run without the tables."""
    if detail_missing(run) is not None:
        return []
    chosen = chosen_capture(run)
    where = f" WHERE {CAPTURE_COLUMN} = ?" if chosen is not None else ""
    params = (chosen.first_step,) * len(DEVICE_TABLES) if chosen is not None else ()
    df = run.query(" UNION ".join(f"SELECT DISTINCT device FROM {t}{where}" for t in DEVICE_TABLES), params)
    if rank is not None:
        df = df[df["rank"] == int(rank)]
    return sorted({d for d in df["device"] if isinstance(d, str)})


def _read(run: StoredRun, table: str, where: Mapping[str, Any], order: str = "", limit: int | None = None,
          extra: str = "") -> pd.DataFrame:
    """Rows of a detail table (all its columns and ``rank``), filtered by ``where`` (column -> value; ``rank`` is
    the file's), ordered and cut to ``limit`` rows per file. A run without the tables: no rows, the columns."""
    columns = list(DETAIL_TABLES[table])
    if detail_missing(run) is not None:
        return _typed(pd.DataFrame({c: [] for c in [*columns, "rank"]}), table)
    conds: list[str] = []
    params: list[Any] = []
    chosen = chosen_capture(run) if table != "stream_spans" else None  # the Timeline's lanes: every captured step
    if chosen is not None:
        conds.append(f"{CAPTURE_COLUMN} = ?")
        params.append(chosen.first_step)
    for column, value in where.items():
        if column != "rank" and value is not None:
            conds.append(f"{column} = ?")
            params.append(value)
    if extra:
        conds.append(extra)
    sql = f"SELECT {', '.join(columns)} FROM {table}"
    if conds:
        sql += " WHERE " + " AND ".join(conds)
    if order:
        sql += f" ORDER BY {order}"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    df = run.query(sql, tuple(params))
    rank = where.get("rank")
    if rank is not None:
        df = df[df["rank"] == int(rank)]
    return _typed(df, table).reset_index(drop=True)


def _typed(df: pd.DataFrame, table: str) -> pd.DataFrame:
    """Each column as its SQL type says, whatever SQLite gave (an all-NULL column reads as objects): REAL as
    float (NULL: NaN), INTEGER as Int64 (NULL: NA), the flags as boolean.

    A value that is no such figure (text in a number's column, a fraction in a count's, an infinity, a count past
    MAX_VALUE: a damaged file, dpprof.store.validation) reads as missing, never as an error."""
    for column, kind in DETAIL_TABLES[table].items():
        if kind not in ("REAL", "INTEGER"):
            continue
        values = pd.to_numeric(df[column], errors="coerce").astype(float)
        values = values.where(np.isfinite(values) & (values.abs() <= MAX_VALUE))
        if column in _BOOLEAN:
            df[column] = values.where(values.isin([0.0, 1.0])).astype("boolean")
        elif kind == "INTEGER":
            df[column] = values.where(values == values.round()).astype("Int64")
        else:
            df[column] = values
    return df


def _top(df: pd.DataFrame, by: str, top: int | None) -> pd.DataFrame:
    df = df.sort_values(by, ascending=False, kind="stable", na_position="last")
    return (df.head(top) if top is not None else df).reset_index(drop=True)


def operators(run: StoredRun, by: str = "name", rank: int | None = None, device: str | None = None,
              top: int | None = None, search: str | None = None, sort: str = "host_total_ms") -> pd.DataFrame:
    """Operators per rank and device, largest first.

    Args:
        by: "name", or "shape" (name and input shapes: an ``input_shapes`` column).
        rank, device: only these. top: the first N (by ``sort``). search: names containing this text.
        sort: the column the rows are ordered by (default host total time).

    Returns:
        columns rank, device, name, [input_shapes], calls, host_total_ms, host_self_ms, device_total_ms,
        device_self_ms, tc_eligible, tc_pct (NaN device times on a CPU-only trace).
    """
    if by not in ("name", "shape"):
        raise ValueError(f"by must be 'name' or 'shape', not {by!r}")
    table = "operators" if by == "name" else "operator_shapes"
    if sort not in DETAIL_TABLES[table]:
        raise ValueError(f"cannot sort operators by {sort!r}")
    extra = "instr(lower(name), lower(?)) > 0" if search else ""
    df = _read_search(run, table, {"rank": rank, "device": device}, sort, extra, search)
    return _first(_top(df, sort, top))


def _read_search(run: StoredRun, table: str, where: Mapping[str, Any], sort: str, extra: str,
                 search: str | None) -> pd.DataFrame:
    if not search:
        return _read(run, table, where, f"{sort} DESC")
    df = _read(run, table, where, f"{sort} DESC")
    return df[df["name"].str.contains(search, case=False, regex=False)].reset_index(drop=True)


def _first(df: pd.DataFrame) -> pd.DataFrame:
    """``rank`` as the first column, as the issue's JSON lists it."""
    return df[["rank", *[c for c in df.columns if c != "rank"]]]


def kernels(run: StoredRun, by: str = "name", rank: int | None = None, device: str | None = None,
            top: int | None = None, search: str | None = None) -> pd.DataFrame:
    """Kernels per rank and device, by total time.

    Args:
        by: "name", or "operator" (kernel and the operator that launched it, with grid, block,
            registers_per_thread and shared_memory_bytes).

    Returns:
        columns rank, device, name, [operator, grid, block, registers_per_thread, shared_memory_bytes], calls,
        total_ms, mean_ms, min_ms, max_ms, mean_blocks_per_sm, mean_occupancy_pct, tensor_cores.
    """
    if by not in ("name", "operator"):
        raise ValueError(f"by must be 'name' or 'operator', not {by!r}")
    table = "kernels" if by == "name" else "kernel_ops"
    df = _read_search(run, table, {"rank": rank, "device": device}, "total_ms", "", search)
    return _first(_top(df, "total_ms", top))


def gpu_metrics(run: StoredRun, rank: int | None = None, device: str | None = None) -> pd.DataFrame:
    """Per rank, device and step: columns rank, device, step, window_ms, busy_ms, utilization_pct,
    sm_efficiency_pct, achieved_occupancy_pct (the TensorBoard plugin's definitions: dpprof.trace.detail)."""
    df = _read(run, "gpu_metrics", {"rank": rank, "device": device}, "device, step", extra="step IS NOT NULL")
    return _first(df)


def gpu_summary(run: StoredRun, rank: int | None = None, device: str | None = None) -> pd.DataFrame:
    """Per rank and device, all steps together: columns rank, device, window_ms, busy_ms, utilization_pct,
    sm_efficiency_pct, achieved_occupancy_pct."""
    df = _read(run, "gpu_metrics", {"rank": rank, "device": device}, "device", extra="step IS NULL")
    return _first(df.drop(columns="step"))


def memory_timeline(run: StoredRun, rank: int | None = None, device: str | None = None) -> pd.DataFrame:
    """Allocated and reserved bytes over time per rank and device (at most dpprof.trace.detail.MEMORY_POINTS points
    a device, each a bucket's maximum): columns rank, device, t_ms, allocated_bytes, reserved_bytes."""
    return _first(_read(run, "memory_timeline", {"rank": rank, "device": device}, "device, t_ms"))


def memory_peaks(run: StoredRun, rank: int | None = None, device: str | None = None) -> pd.DataFrame:
    """Per rank and device: columns rank, device, peak_allocated_bytes, peak_reserved_bytes, peak_t_ms, peak_step,
    readings, cumulative (allocated is the running sum of the events' Bytes)."""
    return _first(_read(run, "memory_peaks", {"rank": rank, "device": device}, "device"))


def memory_events(run: StoredRun, rank: int | None = None, device: str | None = None,
                  top: int | None = None) -> pd.DataFrame:
    """Allocations paired with their frees: columns rank, device, operator, bytes, alloc_t_ms, free_t_ms,
    lifetime_ms (NaN: not freed in the trace), in time order; ``top``: the largest N."""
    df = _read(run, "memory_events", {"rank": rank, "device": device}, "alloc_t_ms")
    if top is not None:
        df = df.nlargest(top, "bytes", keep="first").sort_values("alloc_t_ms", kind="stable")
    return _first(df.reset_index(drop=True))


def operator_memory(run: StoredRun, rank: int | None = None, device: str | None = None,
                    top: int | None = None) -> pd.DataFrame:
    """Per operator: columns rank, device, name, calls, allocations, allocated_bytes, frees, freed_bytes,
    size_increase_bytes, by bytes allocated."""
    df = _read(run, "operator_memory", {"rank": rank, "device": device}, "allocated_bytes DESC")
    return _first(_top(df, "allocated_bytes", top))


def modules(run: StoredRun, rank: int | None = None, device: str | None = None) -> pd.DataFrame:
    """The nn.Module tree: columns rank, device, path ("Sequential_0/Linear_1"), module, parent (its path; None at
    the root), occurrences, operators, host_total_ms, device_total_ms."""
    return _first(_read(run, "modules", {"rank": rank, "device": device}, "rowid"))


def stream_spans(run: StoredRun, first_step: int, last_step: int) -> pd.DataFrame:
    """The GPU streams' kernel spans of steps first_step..last_step (dpprof.trace.detail.STREAM_SPAN_COLUMNS): columns
    rank, device, stream, step, start_ms, duration_ms, busy_ms, kernels, by start; no rows for a run without them
    (no kernels, or imported before dpprof kept its streams)."""
    have = run.query("SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'stream_spans'")["n"]
    if not len(have) or not (have > 0).all():
        return _typed(pd.DataFrame({c: [] for c in [*DETAIL_TABLES["stream_spans"], "rank"]}), "stream_spans")
    return _first(_read(run, "stream_spans", {}, "start_ms", extra=f"step BETWEEN {int(first_step)} AND "
                                                                    f"{int(last_step)}"))


def detail_notes(run: StoredRun) -> list[str]:
    """What was left out of the detail tables and why, one line each (every rank's)."""
    if detail_missing(run) is not None:
        return []
    chosen = chosen_capture(run)
    if chosen is None:
        return [str(m) for m in run.query("SELECT message FROM detail_notes")["message"]]
    return [str(m) for m in run.query(f"SELECT message FROM detail_notes WHERE {CAPTURE_COLUMN} = ?",
                                      (chosen.first_step,))["message"]]
