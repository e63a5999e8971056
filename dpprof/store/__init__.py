"""Runs on disk: one SQLite file per run, written in the background, read as DataFrames."""
from dpprof.store.reader import RunFileError, StoredRun, list_runs, load_run, reports_dir
from dpprof.store.writer import SqliteSink

__all__ = ["list_runs", "load_run", "StoredRun", "RunFileError", "reports_dir", "SqliteSink"]
