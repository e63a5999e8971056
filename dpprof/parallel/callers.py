"""The script's line for a warning dpprof gives on its behalf: past dpprof's own frames and Module's call.

Below data_parallel, scatter_gather and distributed, which all warn at the line that called the model."""
from __future__ import annotations

import os
import sys
from types import FrameType

from torch.nn import Module

__all__ = ["PACKAGE_DIR", "caller_level"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dpprof/: its frames are not a script's
# dpprof's own files and Module.__call__'s: the frames between a script's model(x) and a warning dpprof gives there
_CALL_FILES = (PACKAGE_DIR, os.path.abspath(sys.modules[Module.__module__].__file__ or ""))


def caller_level() -> int:
    """The ``stacklevel`` of the caller's line for a warning given by the function that calls this: past dpprof's
    frames and Module's call, however many there are (dpprof run's stand-in adds a forward of its own)."""
    level = 1
    frame: FrameType | None = sys._getframe(2)  # the warning's function's caller
    while frame is not None and frame.f_code.co_filename.startswith(_CALL_FILES):
        frame, level = frame.f_back, level + 1
    return level + 1
