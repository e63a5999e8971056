"""torch.profiler (Kineto) traces as dpprof runs: a streaming reader, and ``import_traces`` that writes
a run through the store's writer (``dpprof import``).

The names below are imported on first use (dpprof.lazy): a process that only reads trace files (an import's
worker) loads neither the store nor pandas."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dpprof.lazy import lazy_names

if TYPE_CHECKING:
    from dpprof.trace.decode import TraceError, TraceFile, is_trace_name
    from dpprof.trace.importer import (SOURCE, AlreadyImported, ImportedRun, import_traces, pending_traces,
                                       trace_files)

__all__ = ["TraceError", "AlreadyImported", "TraceFile", "ImportedRun", "import_traces", "pending_traces", "trace_files",
           "is_trace_name", "SOURCE"]

__getattr__, __dir__ = lazy_names(__name__, {
    **dict.fromkeys(["AlreadyImported", "ImportedRun", "import_traces", "pending_traces", "trace_files", "SOURCE"],
                    "dpprof.trace.importer"),
    **dict.fromkeys(["TraceError", "TraceFile", "is_trace_name"], "dpprof.trace.decode")}, globals())
