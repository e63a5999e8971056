"""torch.profiler ranges that cost a flag check, not an op call, when no profiler is on.

``record_function`` goes through torch's op dispatcher on enter and exit (several microseconds
each), profiler or not. While torch.profiler is on, dpprof uses it, so each phase shows as a
``user_annotation`` range; otherwise it uses torch's C++ fast range, which costs well under a
microsecond and still shows (as a ``cpu_op``) to a profiler started outside Python.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd import profiler as _torch_profiler
from torch.autograd.profiler import record_function

__all__ = ["profiler_range", "profiler_on"]

_FAST = getattr(torch._C._profiler, "_RecordFunctionFast", None)


def profiler_on() -> bool:
    """Whether a torch.profiler is recording (torch's own fast Python check; all-threads profiling included)."""
    return _torch_profiler._is_profiler_enabled


def profiler_range(name: str) -> Any:
    """A context manager: the range ``name`` in any torch.profiler trace."""
    if _FAST is None or _torch_profiler._is_profiler_enabled:
        return record_function(name)
    return _FAST(name)
