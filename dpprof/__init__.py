"""dpprof: a profiling and diagnostics workbench for PyTorch data-parallel training."""
from dpprof.parallel import (
    DataParallel,
    DataParallelCriterion,
    DataParallelModel,
    DistributedDataParallel,
    cpu_devices,
    data_parallel,
    gather,
    parallel_apply,
    replicate,
    scatter,
    scatter_kwargs,
)
from dpprof.devices import check_balance
from dpprof.instrument import instrument
from dpprof.recording import Run, current_run, record
from dpprof.store import RunFileError, StoredRun, list_runs, load_run
from dpprof.store.faults import RecordingError

__version__ = "0.1.0"

__all__ = ["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
           "DistributedDataParallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
           "parallel_apply", "gather", "record", "current_run", "Run", "list_runs", "load_run", "StoredRun",
           "RunFileError", "RecordingError", "check_balance", "instrument", "__version__"]
