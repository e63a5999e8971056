"""dpprof: a profiling and diagnostics workbench for PyTorch data-parallel training."""
from dpprof.parallel import (
    DataParallel,
    cpu_devices,
    data_parallel,
    gather,
    parallel_apply,
    replicate,
    scatter,
    scatter_kwargs,
)
from dpprof.recording import Run, current_run, record
from dpprof.store import RunFileError, StoredRun, list_runs, load_run

__version__ = "0.1.0"

__all__ = ["DataParallel", "data_parallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
           "parallel_apply", "gather", "record", "current_run", "Run", "list_runs", "load_run", "StoredRun",
           "RunFileError", "__version__"]
