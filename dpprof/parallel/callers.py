"""The line a warning names past dpprof's frames: one walk, for warnings dpprof gives and torch's it wraps.

Below data_parallel and scatter_gather (dpprof's warnings, at the line that called the model), distributed and fsdp
(torch's, at the line they name without dpprof)."""
from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

from torch.nn import Module

__all__ = ["PACKAGE_DIR", "WarningsPastDpprof", "caller_level", "frames_in"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dpprof/: its frames are not a script's
# dpprof's own files and Module.__call__'s: the frames between a script's model(x) and a warning dpprof gives there
_CALL_FILES = (PACKAGE_DIR, os.path.abspath(sys.modules[Module.__module__].__file__ or ""))


def frames_in(frame: FrameType | None, files: tuple[str, ...]) -> int:
    """How many frames from ``frame`` outward (it, its caller, ...) run code of ``files``: the levels a warning's
    ``stacklevel`` steps over to name the first line past them."""
    count = 0
    while frame is not None and frame.f_code.co_filename.startswith(files):
        frame, count = frame.f_back, count + 1
    return count


def caller_level() -> int:
    """The ``stacklevel`` of the caller's line for a warning given by the function that calls this: past dpprof's
    frames and Module's call, however many there are (dpprof run's stand-in adds a forward of its own)."""
    return 2 + frames_in(sys._getframe(2), _CALL_FILES)  # 2: the warning's function, then its caller


class WarningsPastDpprof:
    """``warnings`` as a torch module dpprof wraps sees it: a warning it gives at a caller's line (``stacklevel=2``, as
    FSDP2's post-forward for a module that returned a view tensor, DDP's constructor for ``broadcast_buffers``) names
    the line it names without dpprof, past dpprof's frames (a wrapper of the function that warns, a subclass's
    constructor) that would otherwise be that caller; every other name torch's own. Not ``catch_warnings``: entering it
    resets every module's once-only warnings, process-wide."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def warn(self, message: Any, category: Any = None, stacklevel: int = 1, *args: Any, **kwargs: Any) -> None:
        frame: FrameType | None = sys._getframe(1)  # the function that warns: stacklevel 1
        for _ in range(stacklevel - 1):
            frame = frame.f_back if frame is not None else None
        stacklevel += frames_in(frame, (PACKAGE_DIR,))
        self._inner.warn(message, category, stacklevel + 1, *args, **kwargs)  # + 1: this frame
