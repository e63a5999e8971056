"""The run file's schema: one SQLite file per run, versioned, record tables derived from dpprof.records."""
from __future__ import annotations

import types
import typing
from dataclasses import fields

from dpprof.records import TABLE_OF

__all__ = ["SCHEMA_VERSION", "FORMAT", "RECORD_TABLES", "RUN_COLUMNS", "ddl", "columns_of"]

SCHEMA_VERSION = 1
FORMAT = "dpprof-run"  # meta.format: tells a dpprof run from any other SQLite file

RECORD_TABLES = TABLE_OF

RUN_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "name": "TEXT", "created_at": "TEXT", "ended_at": "TEXT",
    "heartbeat_at": "TEXT",  # last writer commit: a running run that stops beating is incomplete
    "host": "TEXT", "pid": "INTEGER", "torch_version": "TEXT", "cuda_version": "TEXT",
    "backend": "TEXT", "devices": "TEXT",  # JSON list of device labels
    "workload": "TEXT", "workload_args": "TEXT",  # JSON object
    "status": "TEXT",  # running | finished | failed | (read side) incomplete
    "error": "TEXT", "dropped_records": "INTEGER",
}

# Tables the collectors beyond DataParallel fill; every run has them.
_EXTRA_TABLES = {
    "devices": {
        "device": "TEXT", "kind": "TEXT", "name": "TEXT", "total_memory_bytes": "INTEGER",
        "multiprocessor_count": "INTEGER", "capability": "TEXT", "pci_bus_id": "TEXT",
        "nvml_index": "INTEGER", "cpu_model": "TEXT", "cores": "INTEGER", "threads": "INTEGER",
    },
    "gpu_samples": {
        "t_ms": "REAL", "device": "TEXT", "gpu_util_pct": "REAL", "memory_util_pct": "REAL",
        "memory_used_bytes": "INTEGER", "memory_total_bytes": "INTEGER", "power_w": "REAL",
        "power_limit_w": "REAL", "temperature_c": "REAL", "sm_clock_mhz": "REAL",
        "pcie_tx_bytes_per_s": "REAL", "pcie_rx_bytes_per_s": "REAL", "throttle_reasons": "TEXT",
        "other_process_memory_bytes": "INTEGER",
    },
    "findings": {
        "kind": "TEXT", "severity": "TEXT", "device": "TEXT", "title": "TEXT", "evidence": "TEXT",
        "advice": "TEXT", "value": "REAL",
    },
    "notes": {"t_ms": "REAL", "source": "TEXT", "message": "TEXT"},  # missing-data reasons, once each
}

_SQL_TYPES = {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"}


def _sql_type(annotation: object) -> str:
    hint = eval(annotation, {}) if isinstance(annotation, str) else annotation  # "int | None" under PEP 563
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
    statements = ["CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
                  _create("runs", RUN_COLUMNS)]
    statements += [_create(t, columns_of(cls)) for cls, t in RECORD_TABLES.items()]
    statements += [_create(t, cols) for t, cols in _EXTRA_TABLES.items()]
    statements += ["CREATE INDEX IF NOT EXISTS phases_step ON phases (step)",
                   "CREATE INDEX IF NOT EXISTS memory_step ON memory (step)"]
    return statements
