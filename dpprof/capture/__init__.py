"""Deep capture: a window of a recorded run's steps profiled with torch.profiler (operators, kernels, memory).

``window`` parses and checks a window (``"A:B"``: steps A to B-1) and ``request`` asks a running run for one; both
load no torch, so the CLI, the dashboard and :class:`dpprof.launch.Profile` use them without it. ``session`` runs
torch.profiler inside the recorder (dpprof.recording) and is imported only there.
"""
from __future__ import annotations

from dpprof.capture.window import MAX_CAPTURE_STEPS, CaptureError, CaptureWindow, parse_capture

__all__ = ["MAX_CAPTURE_STEPS", "CaptureError", "CaptureWindow", "parse_capture"]
