"""Runs on disk: one SQLite file per run, written in the background, read as DataFrames.

The names below are imported on first use (dpprof.lazy): importing one store module loads no other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dpprof.lazy import lazy_names

if TYPE_CHECKING:
    from dpprof.store.faults import RunFileError
    from dpprof.store.reader import StoredRun, list_runs, load_run, reports_dir
    from dpprof.store.writer import SqliteSink

__all__ = ["list_runs", "load_run", "StoredRun", "RunFileError", "reports_dir", "SqliteSink"]

__getattr__, __dir__ = lazy_names(__name__, {
    **dict.fromkeys(["list_runs", "load_run", "StoredRun", "reports_dir"], "dpprof.store.reader"),
    "RunFileError": "dpprof.store.faults", "SqliteSink": "dpprof.store.writer"}, globals())
