"""Whole tables of a run and their row counts, as the Export page and ``dpprof export`` offer them
(dpprof.views.export).

These read a table's rows as they are stored, each rank's with a ``rank`` column (StoredRun.query's shape),
record tables and per-block aggregate tables alike; StoredRun.table is the cached read of a record table.
"""
from __future__ import annotations

import pandas as pd

from dpprof.store.reader import TABLES, StoredRun
from dpprof.store.schema import AGGREGATE_TABLES

__all__ = ["row_count", "stored_tables", "whole_table"]


def stored_tables() -> tuple[str, ...]:
    """Every table a run file may hold: the record tables, then the aggregate tables."""
    return (*TABLES, *AGGREGATE_TABLES)


def _table(name: str) -> str:
    """``name`` if a run file may hold it, else a KeyError naming it."""
    if name not in stored_tables():
        raise KeyError(f"no table {name!r}; tables are {', '.join(stored_tables())}")
    return name


def whole_table(run: StoredRun, name: str) -> pd.DataFrame:
    """Every row of table ``name`` (a record or an aggregate table), each rank's with a ``rank`` column."""
    return run.query(f"SELECT * FROM {_table(name)}")


def row_count(run: StoredRun, name: str) -> int:
    """How many rows table ``name`` holds, over every rank's file."""
    return int(run.query(f"SELECT COUNT(*) AS n FROM {_table(name)}")["n"].sum())
