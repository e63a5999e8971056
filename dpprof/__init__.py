"""dpprof: a profiling and diagnostics workbench for PyTorch data-parallel training.

Reading runs (``list_runs``, ``load_run``) loads neither torch nor pynvml: the names that record
(``DataParallel``, ``record``, ``instrument``, ...) are imported on first use (PEP 562).
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from dpprof.store import RunFileError, StoredRun, list_runs, load_run
from dpprof.store.faults import RecordingError

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ below imports these
    from dpprof.devices import check_balance
    from dpprof.instrument import instrument
    from dpprof.parallel import (DataParallel, DataParallelCriterion, DataParallelModel, DistributedDataParallel,
                                 cpu_devices, data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs)
    from dpprof.recording import Run, current_run, record

__version__ = "0.1.0"

# The collect side, by the module each name comes from: imported (with torch) the first time one is used.
_COLLECT = {
    **dict.fromkeys(["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
                     "DistributedDataParallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
                     "parallel_apply", "gather"], "dpprof.parallel"),
    **dict.fromkeys(["record", "current_run", "Run"], "dpprof.recording"),
    "instrument": "dpprof.instrument",
    "check_balance": "dpprof.devices",
}

__all__ = ["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
           "DistributedDataParallel", "cpu_devices", "scatter", "scatter_kwargs", "replicate",
           "parallel_apply", "gather", "record", "current_run", "Run", "list_runs", "load_run", "StoredRun",
           "RunFileError", "RecordingError", "check_balance", "instrument", "__version__"]


def __getattr__(name: str) -> Any:
    """A collect-side name, imported on first use and kept in the module's globals from then on."""
    module = _COLLECT.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """dpprof's own module type. ``dpprof.instrument`` is the function, while ``dpprof/instrument.py`` is also a
    submodule: importing that submodule first (``from dpprof.instrument import ...``) would bind the module to the
    name, so the binding keeps the function of the same name instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _COLLECT and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
