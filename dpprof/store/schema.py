"""The run file's schema: one SQLite file per run, versioned, record tables derived from dpprof.records."""
from __future__ import annotations

import types
import typing
from dataclasses import fields

from dpprof.records import MEMORY_BYTES, TABLE_OF

__all__ = ["SCHEMA_VERSION", "FORMAT", "RECORD_TABLES", "RUN_COLUMNS", "INDEXES", "LEGACY_INDEXES",
           "AGGREGATE_TABLES", "TABLES", "CHECKED_TABLES", "ddl", "columns_of", "DETAIL_TABLES", "detail_ddl",
           "CAPTURE_COLUMN", "CAPTURES_TABLE"]

# 2: per-block aggregates (dpprof.store.blocks) and bounded detail (dpprof.store.retention); a version-1 file
# holds every row and no aggregates, and reads as before.
SCHEMA_VERSION = 2
FORMAT = "dpprof-run"  # meta.format: tells a dpprof run from any other SQLite file

RECORD_TABLES = TABLE_OF

RUN_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "name": "TEXT", "created_at": "TEXT", "ended_at": "TEXT",
    "heartbeat_at": "TEXT",  # last writer commit: a running run that stops beating is incomplete
    "host": "TEXT", "pid": "INTEGER", "torch_version": "TEXT", "cuda_version": "TEXT",
    "backend": "TEXT", "devices": "TEXT",  # JSON list of device labels
    "workload": "TEXT", "workload_args": "TEXT",  # JSON object
    "status": "TEXT",  # running | finished | failed | interrupted | disk_full | (read side) incomplete
    "error": "TEXT", "dropped_records": "INTEGER",
    "rank": "INTEGER", "world_size": "INTEGER",  # torch.distributed runs: one file per rank
    "source": "TEXT",  # "trace": imported from torch.profiler traces (dpprof import); None: recorded live
    "detail": "TEXT",  # JSON of the dpprof.store.retention.Retention the run was written with (None: version 1)
    "detail_from": "INTEGER",  # every step from here on still has all its detail rows
}

_SQL_TYPES = {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"}


def _sql_type(annotation: object) -> str:
    hint: typing.Any = eval(annotation, {}) if isinstance(annotation, str) else annotation  # "int | None" under PEP 563
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return _SQL_TYPES[hint]


def columns_of(record_type: type) -> dict[str, str]:
    """Column name -> SQL type for a record dataclass."""
    return {f.name: _sql_type(f.type) for f in fields(record_type)}


def _create(table: str, columns: dict[str, str]) -> str:
    cols = ", ".join(f'"{name}" {kind}' for name, kind in columns.items())
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols})"


def ddl() -> list[str]:
    """Statements that create an empty run file of this schema version."""
    statements = ["PRAGMA auto_vacuum = INCREMENTAL",  # pages the retention frees are given back at close
                  "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
                  _create("runs", RUN_COLUMNS)]
    statements += [_create(t, columns_of(cls)) for cls, t in RECORD_TABLES.items()]
    for table, (columns, key) in AGGREGATE_TABLES.items():
        cols = ", ".join(f'"{name}" {kind}' for name, kind in columns.items())
        tail = f", PRIMARY KEY ({', '.join(key)})) WITHOUT ROWID" if key else ")"
        statements.append(f"CREATE TABLE IF NOT EXISTS {table} ({cols}{tail}")
    statements += [f"CREATE INDEX IF NOT EXISTS {name} ON {spec}" for name, spec in INDEXES.items()]
    return statements


# Indices the read side needs to find a range of steps in a run's detail rows (the Timeline, a long run's sample,
# the retention's deletions: dpprof.store.retention). Each costs the background writer a little per record,
# never the training step. Whole-run figures come from the per-block aggregates (AGGREGATE_TABLES), so the
# covering indices schema 1 kept for them (LEGACY_INDEXES) are no longer made: they doubled the detail's size.
INDEXES = {
    "phases_step": "phases (step)",  # the timeline: WHERE step BETWEEN a AND b
    "memory_step": "memory (step)",
    # the allocator's per-device peaks of a short run are one index lookup each (a CUDA run has 2 x devices rows a step)
    "allocator_peak": "allocator (device, peak_allocated_bytes)",
    "allocator_reserved": "allocator (device, reserved_bytes)",
    "allocator_step": "allocator (step)",
    "comms_step": "comms (step)",
}
# Made in schema-1 files (read as they are): per-device apply statistics and memory peaks read from the index alone.
LEGACY_INDEXES = {
    "phases_phase": "phases (phase, device, step, duration_ms)",
    "memory_device": ("memory (device, step, chunk_size, input_bytes, output_bytes, activation_bytes, "
                      "gathered_bytes, param_bytes, buffer_bytes)"),
}

_STAT = {"first_step": "INTEGER", "last_step": "INTEGER", "steps": "INTEGER"}
_MS = {"sum_ms": "REAL", "min_ms": "REAL", "max_ms": "REAL"}
# What the writer adds up per block of steps as records arrive (dpprof.store.blocks): table -> (columns, primary
# key). The read side's pages read these for a long run instead of its rows (dpprof.store.queries).
AGGREGATE_TABLES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    # trained_steps: the block's steps a backward ran in (a phase "backward" on any device), trained_samples their
    # batches: the run's samples/s counts those alone where it mixes them with evaluation steps (queries.throughput)
    # after the detail that tells them apart is thinned. A file written before them has neither column.
    # raised_steps: the block's steps whose forward raised and ran no backward (queries.raised_steps_of), neither
    # training nor evaluation steps; a file written before it has no such column (and no such step told apart).
    "step_blocks": ({"block": "INTEGER", **_STAT, **_MS, "batch_size": "INTEGER", "devices_used": "INTEGER",
                     "sketch": "BLOB", "trained_steps": "INTEGER", "trained_samples": "INTEGER",
                     "raised_steps": "INTEGER"}, ("block",)),
    # per-step sums of each phase on each device (forward calls summed); phase "work" is each device's own share
    "phase_blocks": ({"phase": "TEXT", "device": "TEXT", "block": "INTEGER", **_STAT, "calls": "INTEGER", **_MS,
                      "device_sum_ms": "REAL", "slowest_steps": "INTEGER", "wait_sum_ms": "REAL", "sketch": "BLOB"},
                     ("phase", "device", "block")),
    "memory_blocks": ({"device": "TEXT", "block": "INTEGER", **_STAT, "calls": "INTEGER", "held_sum_bytes": "INTEGER",
                       "peak_step": "INTEGER", "peak_held_bytes": "INTEGER",
                       **{c: "INTEGER" for c in MEMORY_BYTES}}, ("device", "block")),
    "allocator_blocks": ({"device": "TEXT", "phase": "TEXT", "block": "INTEGER", "rows": "INTEGER",
                          "allocated_max_bytes": "INTEGER", "peak_allocated_bytes": "INTEGER",
                          "reserved_max_bytes": "INTEGER", "peak_step": "INTEGER"}, ("device", "phase", "block")),
    "chunk_counts": ({"device": "TEXT", "chunk_size": "INTEGER", "calls": "INTEGER"}, ()),
    "outlier_steps": ({"step": "INTEGER", "duration_ms": "REAL", "median_ms": "REAL"}, ("step",)),
    # the whole run's sketches, merged as steps settle: "step" (device ''), its steps a backward ran in, "training",
    # and the others, "evaluation" (device ''; a file written before them has neither), and "work" per device; a page
    # reads a long run's median step, each kind's, and each device's p50 and p95 from these few rows, not from every
    # block's
    "run_sketches": ({"kind": "TEXT", "device": "TEXT", "sketch": "BLOB"}, ("kind", "device")),
}
TABLES = tuple(RECORD_TABLES.values())
# Every table a reader queries: each is checked for bad values (dpprof.store.validation) when a run is first read.
CHECKED_TABLES = (*TABLES, *AGGREGATE_TABLES)

# The operator, kernel, GPU-metric, memory and module tables of a torch.profiler trace (dpprof.trace.detail), in a
# run imported from traces or a run with a deep capture (dpprof.store.detail_rows.write_detail). A file written
# before them has none of them and reads as "no operator data", with the reason: no version change is needed.
_DEV = {"device": "TEXT"}
_OPS = {"calls": "INTEGER", "host_total_ms": "REAL", "host_self_ms": "REAL", "device_total_ms": "REAL",
        "device_self_ms": "REAL", "tc_eligible": "INTEGER", "tc_pct": "REAL"}
_KERNEL_STATS = {"calls": "INTEGER", "total_ms": "REAL", "mean_ms": "REAL", "min_ms": "REAL", "max_ms": "REAL",
                 "mean_blocks_per_sm": "REAL", "mean_occupancy_pct": "REAL", "tensor_cores": "INTEGER"}
DETAIL_TABLES: dict[str, dict[str, str]] = {
    "operators": {**_DEV, "name": "TEXT", **_OPS},
    "operator_shapes": {**_DEV, "name": "TEXT", "input_shapes": "TEXT", **_OPS},
    "kernels": {**_DEV, "name": "TEXT", **_KERNEL_STATS},
    "kernel_ops": {**_DEV, "name": "TEXT", "operator": "TEXT", "grid": "TEXT", "block": "TEXT",
                   "registers_per_thread": "INTEGER", "shared_memory_bytes": "INTEGER", **_KERNEL_STATS},
    "gpu_metrics": {**_DEV, "step": "INTEGER", "window_ms": "REAL", "busy_ms": "REAL", "utilization_pct": "REAL",
                    "sm_efficiency_pct": "REAL", "achieved_occupancy_pct": "REAL"},
    "memory_timeline": {**_DEV, "t_ms": "REAL", "allocated_bytes": "INTEGER", "reserved_bytes": "INTEGER"},
    "memory_peaks": {**_DEV, "peak_allocated_bytes": "INTEGER", "peak_reserved_bytes": "INTEGER",
                     "peak_t_ms": "REAL", "peak_step": "INTEGER", "readings": "INTEGER", "cumulative": "INTEGER"},
    "memory_events": {**_DEV, "operator": "TEXT", "bytes": "INTEGER", "alloc_t_ms": "REAL", "free_t_ms": "REAL",
                      "lifetime_ms": "REAL"},
    "operator_memory": {**_DEV, "name": "TEXT", "calls": "INTEGER", "allocations": "INTEGER",
                        "allocated_bytes": "INTEGER", "frees": "INTEGER", "freed_bytes": "INTEGER",
                        "size_increase_bytes": "INTEGER"},
    "modules": {**_DEV, "path": "TEXT", "module": "TEXT", "parent": "TEXT", "occurrences": "INTEGER",
                "operators": "INTEGER", "host_total_ms": "REAL", "device_total_ms": "REAL"},
    # the Timeline's GPU stream lanes (dpprof.trace.detail.STREAM_SPAN_COLUMNS)
    "stream_spans": {**_DEV, "stream": "TEXT", "step": "INTEGER", "start_ms": "REAL", "duration_ms": "REAL",
                     "busy_ms": "REAL", "kernels": "INTEGER"},
    "detail_notes": {"message": "TEXT"},
}


# A recorded run keeps every deep capture's tables: each detail table's rows carry the capture they belong to (its
# first step; NULL in an imported trace's run, which has one set of tables), a column the readers filter on and do
# not return. A file written before it has the tables without the column: they read as one capture, and the next
# capture written into the file replaces them (dpprof.store.detail_rows.write_detail).
CAPTURE_COLUMN = "capture"
# One row per deep capture stored in the file: its window and raw trace (a file name in the reports directory).
CAPTURES_TABLE = {"first_step": "INTEGER PRIMARY KEY", "end_step": "INTEGER", "trace": "TEXT"}


def detail_ddl() -> list[str]:
    """Statements that create the detail tables (DETAIL_TABLES, each with CAPTURE_COLUMN) and the captures table
    where a run file has none."""
    return [*(_create(t, {**cols, CAPTURE_COLUMN: "INTEGER"}) for t, cols in DETAIL_TABLES.items()),
            _create("captures", CAPTURES_TABLE)]
