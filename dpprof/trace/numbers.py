"""The numbers a trace may hold, and one-line refusals of those it may not.

A torch.profiler trace is JSON from another program: a time can be ``NaN``, ``Infinity``, negative or
``1e308``, a rank ``"zero"`` or ``2**70``, a step number 5,000 digits long. Nothing of that is stored. The rules:

- **Times** (``ts``, ``dur``, in µs) are finite numbers from 0 to ``MAX_TIME_US``. A ``ProfilerStep#N`` whose
  time breaks this is refused (the import stops, naming the event), as is one of no length it cannot be a
  step of: its ``dur`` missing or not a number. Any other event with such a time (one kernel, one op, one
  memory reading) is left out and counted; the run's notes say how many and which was first.
- **Step numbers** are whole numbers from 0 to ``MAX_STEP``: a larger one is refused.
- **Steps that repeat or overlap** (one process's ProfilerSteps never do): a step number met again keeps its
  first range in time and the later ones are left out; a step that ends after the next one starts is clipped
  to end where that one starts (a step clipped to nothing is left out). The notes say so.
- **baseTimeNanoseconds** is a whole number of ns since 1970 from 0 to ``MAX_BASE_NS``, or absent.
- **distributedInfo** is an object; its ``rank`` a whole number from 0, below its ``world_size``, a whole
  number from 1 to ``MAX_WORLD_SIZE``; its ``backend`` a string. Else the file is refused.
- **Bytes** (a collective's message, the allocator's totals) are whole numbers from 0 to ``MAX_BYTES``: a
  collective's size out of range is unknown; a memory reading out of range is left out and counted.
- **GPU indices** (an event's ``device`` or ``pid``) are whole numbers from 0 to ``MAX_GPU_INDEX``.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_BASE_NS", "MAX_BYTES", "MAX_GPU_INDEX", "MAX_STEP", "MAX_STEP_DIGITS", "MAX_TIME_US", "MAX_WORLD_SIZE",
           "base_time_problem", "distributed_problem", "is_time", "shown", "slack_us", "time_problem", "whole"]

# 142 years in µs. With baseTimeNanoseconds under MAX_BASE_NS (2116) every absolute time stays before 2262, the
# last instant pandas' datetime64[ns] (and so the read side's dates) holds; float64 holds each whole µs exactly.
MAX_TIME_US = float(2 ** 52)
MAX_BASE_NS = 2 ** 62  # ns since 1970: the year 2116 (torch writes the profiler's start, an int64 of ns)
# A step number must stay exact where pandas holds it as float64 (an int column with a gap in it): 2**53 - 1.
MAX_STEP = 2 ** 53 - 1
MAX_STEP_DIGITS = len(str(MAX_STEP))  # more digits than this is refused before int() parses them
# The largest jobs run on ~10^5 GPUs: 2**24 ranks leaves room and keeps ranks far inside SQLite's INTEGER.
MAX_WORLD_SIZE = 2 ** 24
MAX_BYTES = 2 ** 62  # bytes stored as SQLite INTEGER (int64), with room to sum a step's many collectives
MAX_GPU_INDEX = 2 ** 31 - 1  # a GPU index, or the pid Kineto gives a GPU's events: a pid_t (int32)
_SHOWN_CHARS = 40  # a bad value is quoted up to this many characters


def slack_us(t: float) -> float:
    """How far from ``t`` float arithmetic may put a time a trace states exactly: an end is ``ts + dur``, and that
    sum of two decimals comes out an ulp or so off the decimal the trace would write (573885.116 + 64.236 =
    573949.3520000001), so a phase or step ending where the next begins would compare as ending after it. Two ulps
    of ``t``: 1e-10 µs for times from the profiler's start, 0.5 µs for times in µs since 1970."""
    return 2 * math.ulp(t)


def shown(value: Any) -> str:
    """A value as a refusal quotes it: its repr (a newline in it stays ``\\n``: one line), shortened."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2 ** 64:
        return f"2**{value.bit_length() - 1}+" if value > 0 else f"-2**{value.bit_length() - 1}-"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}… ({len(text):,} characters)"


def is_time(value: Any) -> bool:
    """A time or duration in µs a profiler can have written: a finite number from 0 to MAX_TIME_US."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_TIME_US


def whole(value: Any, lo: int, hi: int) -> int | None:
    """``value`` as an int if it is a whole number (an int, or a float with no fraction) from lo to hi, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    return value if lo <= value <= hi else None


def time_problem(field: str, value: Any) -> str:
    """What is wrong with a ``ts`` or ``dur`` that ``is_time`` refused, in words."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{field} {shown(value)} is not a number"
    if math.isnan(value):
        return f"{field} NaN is not a time"
    if math.isinf(value):
        return f"{field} {'-' if value < 0 else ''}infinite is not a time"
    if value < 0:
        return f"{field} {shown(value)} is negative"
    return f"{field} {shown(value)} µs is past any time a profiler writes (at most 2**52 µs, 142 years)"


def base_time_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a trace's ``baseTimeNanoseconds``, or None when it is absent or right."""
    if "baseTimeNanoseconds" not in meta or meta["baseTimeNanoseconds"] is None:
        return None
    value = meta["baseTimeNanoseconds"]
    if whole(value, 0, MAX_BASE_NS) is None:
        return (f"baseTimeNanoseconds {shown(value)} is not a time (a whole number of ns since 1970, "
                "from 0 to 2**62)")
    return None


def distributed_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a trace's ``distributedInfo``, or None when it is absent or right. Where it is right, its
    rank and world_size are made ints in place (a float such as 3.0 is 3)."""
    info = meta.get("distributedInfo")
    if info is None:
        return None
    if not isinstance(info, dict):
        return f"distributedInfo {shown(info)} is not an object"
    world = info.get("world_size")
    if world is not None:
        size = whole(world, 1, MAX_WORLD_SIZE)
        if size is None:
            return f"distributedInfo world_size {shown(world)} is not a world size (a whole number from 1 to 2**24)"
        info["world_size"] = size
    rank = info.get("rank")
    if rank is not None:
        top = (info["world_size"] - 1) if world is not None else MAX_WORLD_SIZE - 1
        number = whole(rank, 0, top)
        if number is None:
            within = f"below its world_size {info['world_size']}" if world is not None else "below 2**24"
            return f"distributedInfo rank {shown(rank)} is not a rank (a whole number from 0, {within})"
        info["rank"] = number
    backend = info.get("backend")
    if backend is not None and not isinstance(backend, str):
        return f"distributedInfo backend {shown(backend)} is not a name"
    return None
