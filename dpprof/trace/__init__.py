"""torch.profiler (Kineto) traces as dpprof runs: a streaming reader, and ``import_traces`` that writes
a run through the store's writer (``dpprof import``)."""
from __future__ import annotations

from dpprof.trace.importer import SOURCE, AlreadyImported, ImportedRun, import_traces, pending_traces, trace_files
from dpprof.trace.decode import TraceError, TraceFile, is_trace_name

__all__ = ["TraceError", "AlreadyImported", "TraceFile", "ImportedRun", "import_traces", "pending_traces", "trace_files",
           "is_trace_name", "SOURCE"]
