"""The rows a trace export reads from a run (dpprof.trace.export), as named reads.

A trace of a long run is written a chunk of steps at a time and its NVML samples a batch of rows at a time, so
that memory stays bounded whatever the run's length: ``chunk_rows`` reads one range of steps, and
``gpu_sample_batches`` yields the samples table in batches of rowids. Each read gives each rank's rows with a
``rank`` column, as StoredRun.query does.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import pandas as pd

from dpprof.records import MEMORY_BYTES
from dpprof.store.reader import StoredRun

__all__ = [
    "ChunkRows",
    "chunk_rows",
    "event_counts",
    "gpu_sample_batches",
    "gpu_sample_rows",
    "held_step_spans",
    "step_rows",
    "steps_total_ms",
]


class ChunkRows(NamedTuple):
    """One range of steps' detail rows, each frame with a ``rank`` column."""

    phases: pd.DataFrame  # step, call, phase, device, start_ms, duration_ms, device_duration_ms
    memory: pd.DataFrame  # step, device, and each of MEMORY_BYTES summed over the step's forward calls
    allocator: pd.DataFrame  # every column of the allocator table
    comms: pd.DataFrame  # every column of the comms table


def step_rows(run: StoredRun) -> pd.DataFrame:
    """Every step: columns step, start_ms, duration_ms, batch_size, devices_used, forward_calls, rank."""
    return run.query("SELECT step, start_ms, duration_ms, batch_size, devices_used, forward_calls FROM steps")


def held_step_spans(run: StoredRun) -> pd.DataFrame:
    """The steps that keep their detail rows, each rank's longest row of each: columns step, longest_ms (a step of
    several forward calls has a row each), rank. Every step of a run not thinned; of a thinned one, the steps from
    ``detail_from`` on and those that retention kept (with phase or memory rows: dpprof.store.retention). Chosen in
    SQLite: a 300,000-step run's step rows take a second to read, its held steps' a tenth of it."""
    model = run.model
    if not model.thinned:
        return run.query("SELECT step, MAX(duration_ms) AS longest_ms FROM steps GROUP BY step")
    return run.query("SELECT step, MAX(duration_ms) AS longest_ms FROM steps WHERE step >= ? OR step IN "
                     "(SELECT step FROM phases UNION SELECT step FROM memory) GROUP BY step", (model.detail_from,))


def steps_total_ms(run: StoredRun) -> float:
    """The sum of every row of the steps table, every rank's."""
    return float(run.query("SELECT TOTAL(duration_ms) AS ms FROM steps")["ms"].sum())


def event_counts(run: StoredRun, first_step: int, last_step: int) -> pd.DataFrame:
    """Rows of first_step..last_step that become trace events, per rank: columns phases, memory (its (step,
    device) pairs: one event each), allocator, comms, rank."""
    return run.query(
        "SELECT (SELECT COUNT(*) FROM phases WHERE step BETWEEN ?1 AND ?2) AS phases, "
        "(SELECT COUNT(*) FROM (SELECT 1 FROM memory WHERE step BETWEEN ?1 AND ?2 GROUP BY step, device)) AS memory, "
        "(SELECT COUNT(*) FROM allocator WHERE step BETWEEN ?1 AND ?2) AS allocator, "
        "(SELECT COUNT(*) FROM comms WHERE step BETWEEN ?1 AND ?2) AS comms", (first_step, last_step))


def gpu_sample_rows(run: StoredRun) -> pd.Series:
    """How many NVML sample rows each rank's file has written (its largest rowid: samples are never deleted, so
    this is their count without a scan), one value per rank."""
    return run.query("SELECT COALESCE(MAX(rowid), 0) AS n FROM gpu_samples")["n"]


def chunk_rows(run: StoredRun, first_step: int, last_step: int) -> ChunkRows:
    """The detail rows of the steps first_step..last_step (ChunkRows)."""
    span = (first_step, last_step)
    sums = ", ".join(f"SUM({c}) AS {c}" for c in MEMORY_BYTES)
    return ChunkRows(
        phases=run.query("SELECT step, call, phase, device, start_ms, duration_ms, device_duration_ms FROM phases "
                         "WHERE step BETWEEN ? AND ?", span),
        memory=run.query(f"SELECT step, device, {sums} FROM memory WHERE step BETWEEN ? AND ? GROUP BY step, device",
                         span),
        allocator=run.query("SELECT * FROM allocator WHERE step BETWEEN ? AND ?", span),
        comms=run.query("SELECT * FROM comms WHERE step BETWEEN ? AND ?", span))


def gpu_sample_batches(run: StoredRun, columns: Sequence[str], batch_rows: int) -> Iterator[pd.DataFrame]:
    """The NVML samples table, ``batch_rows`` rowids at a time (a run of a day holds millions of rows): columns
    t_ms, device, then ``columns`` (names of the gpu_samples table), rank."""
    bad = [c for c in columns if not re.fullmatch(r"[A-Za-z_]\w*", c)]
    if bad:
        raise ValueError(f"gpu_sample_batches: {bad[0]!r} is not a column name")
    wanted = ", ".join(columns)
    last = int(gpu_sample_rows(run).max() or 0)
    for first in range(1, last + 1, batch_rows):
        yield run.query(f"SELECT t_ms, device, {wanted} FROM gpu_samples WHERE rowid BETWEEN ? AND ?",
                        (first, first + batch_rows - 1))
