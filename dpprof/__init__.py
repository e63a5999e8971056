"""dpprof: a profiling and diagnostics workbench for PyTorch data-parallel training.

Every name is imported from its module on first use (PEP 562, dpprof.lazy): reading runs (``list_runs``,
``load_run``) loads neither torch nor pynvml, and a process that uses one part of dpprof (an import's worker
reading trace files) loads no other (pandas, the store).
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from dpprof.lazy import lazy_names

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ below imports these
    from dpprof.devices import check_balance
    from dpprof.instrument import instrument
    from dpprof.parallel import (DataParallel, DataParallelCriterion, DataParallelModel, DistributedDataParallel,
                                 cpu_devices, data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs)
    from dpprof.recording import Run, current_run, record
    from dpprof.store.faults import RecordingError, RunFileError
    from dpprof.store.reader import StoredRun, list_runs, load_run

__version__ = "0.1.0"

# The collect side (imports torch), by the module each name comes from
_COLLECT = {
    **dict.fromkeys(["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
                     "DistributedDataParallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
                     "parallel_apply", "gather"], "dpprof.parallel"),
    **dict.fromkeys(["record", "current_run", "Run"], "dpprof.recording"),
    "instrument": "dpprof.instrument",
    "check_balance": "dpprof.devices",
}
# The read side (imports pandas)
_READ = {**dict.fromkeys(["list_runs", "load_run", "StoredRun"], "dpprof.store.reader"),
         **dict.fromkeys(["RunFileError", "RecordingError"], "dpprof.store.faults")}

__all__ = ["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
           "DistributedDataParallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
           "parallel_apply", "gather", "record", "current_run", "Run", "list_runs", "load_run", "StoredRun",
           "RunFileError", "RecordingError", "check_balance", "instrument", "__version__"]

__getattr__, __dir__ = lazy_names(__name__, {**_COLLECT, **_READ}, globals())


class _Package(types.ModuleType):
    """dpprof's own module type. ``dpprof.instrument`` is the function, while ``dpprof/instrument.py`` is also a
    submodule: importing that submodule first (``from dpprof.instrument import ...``) would bind the module to the
    name, so the binding keeps the function of the same name instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _COLLECT and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

# the DataLoader watch from the first import, once torch's DataLoader is (loading no torch itself): an iterator made
# before a run starts is seen (dpprof.loaders)
from dpprof.loaders import watch as _watch_loaders  # noqa: E402

_watch_loaders()
