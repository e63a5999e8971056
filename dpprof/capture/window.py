"""A capture window: the steps of a run that torch.profiler records, written ``A:B`` (steps A to B-1).

One form everywhere: ``dpprof profile --capture A:B``, ``dpprof run --capture A:B`` and
``dpprof.record(capture="A:B")``, as ``dpprof export --steps A:B`` writes a range of steps. A bad window is a
:class:`CaptureError` in one line that names the value and what is wrong with it.

Example:
    >>> parse_capture("10:15")
    CaptureWindow(first_step=10, end_step=15)
    >>> parse_capture("10:15").steps
    5
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_CAPTURE_STEPS", "CaptureError", "CaptureWindow", "parse_capture"]

# At most this many steps in one window: a profiled step of a real model holds thousands of events, and Perfetto and
# chrome://tracing open traces up to about a million (dpprof export's own limit), so a longer window writes a trace
# no viewer opens and holds the profiler's whole buffer in memory until it stops.
MAX_CAPTURE_STEPS = 1000
# ASCII digits (\d takes any script's, "１:２"); a minus sign read, for 0 <= A < B to refuse it in its own words
_WINDOW = re.compile(r"\s*(-?[0-9]+)\s*:\s*(-?[0-9]+)\s*")


class CaptureError(ValueError):
    """A capture window or request that cannot be used; the message is one line naming the value.

    ``reason`` is the message without the value's name, for a caller that names it its own way (``--capture 4:2``).
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def _bad(value: object, reason: str) -> CaptureError:
    return CaptureError(f"capture window {value}: {reason}", reason)


@dataclass(frozen=True)
class CaptureWindow:
    """Steps ``first_step`` to ``end_step - 1`` of a run, profiled with torch.profiler.

    Attributes:
        first_step: the first step profiled (steps count from 0, as run.step() numbers them).
        end_step: the step after the last one profiled (the profiler stops as it begins).
    """

    first_step: int
    end_step: int

    def __post_init__(self) -> None:
        if self.first_step < 0 or self.end_step <= self.first_step:
            raise _bad(f"{self.first_step}:{self.end_step}", "steps A:B need 0 <= A < B")
        if self.steps > MAX_CAPTURE_STEPS:
            raise _bad(self, f"{self.steps:,} steps, at most {MAX_CAPTURE_STEPS:,} in one window (a longer trace "
                             "opens in no viewer)")

    @property
    def steps(self) -> int:
        """How many steps the window holds."""
        return self.end_step - self.first_step

    def __str__(self) -> str:
        return f"{self.first_step}:{self.end_step}"


def parse_capture(value: str | CaptureWindow | None) -> CaptureWindow | None:
    """A capture window from its text ``"A:B"`` (steps A to B-1); None for None.

    Raises:
        CaptureError: anything but two whole numbers ``A:B`` with ``0 <= A < B`` (a range or a list names the
            form to use).
    """
    if value is None or isinstance(value, CaptureWindow):
        return value
    if not isinstance(value, str):
        raise CaptureError(f"capture={value!r}: give the window as text \"A:B\" (steps A to B-1), e.g. \"10:15\"",
                           "give the window as text A:B (steps A to B-1), e.g. 10:15")
    match = _WINDOW.fullmatch(value)
    if match is None:
        raise _bad(repr(value), "expected A:B, steps A to B-1 such as 10:15")
    return CaptureWindow(int(match.group(1)), int(match.group(2)))
