"""What makes a finding worth a user's time: the floors under which nothing is said, the grades above them,
and the one definition of a device's imbalance that the findings and the Overview share.

Every finding states what it costs (milliseconds a step and seconds over the run, or bytes) and is raised
only when that cost clears these floors, so a 2-worker toy run does not read "critical" over 0.03 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.units import mib

__all__ = ["TIME_FLOOR_MS", "STEP_SHARE_FLOOR", "MEMORY_FLOOR_BYTES", "CRITICAL_STEP_SHARE", "critical_or", "critical_share_or", "worth_time",
           "worth_bytes", "Imbalance", "imbalance", "total_text", "cost_text", "mib"]

# A finding about time is raised only when it costs at least this much a step ...
# Under a quarter of a millisecond is about three hand-offs to a CPU worker thread (53-78 us each, measured
# in the README's CPU-worker figures) or the Python between two ops: no change to a model, a batch or the
# devices buys it back.
TIME_FLOOR_MS = 0.25
# ... and at least this share of the step: under 2% is inside one step's run-to-run variation on a quiet
# machine (the median step of repeated runs moves by 1-3%).
STEP_SHARE_FLOOR = 0.02
# A finding about memory is raised only when it costs at least this many bytes: the CUDA caching allocator
# reserves large blocks in 2 MiB segments, so a smaller difference is rounding that never decides whether a
# batch fits.
MEMORY_FLOOR_BYTES = 2 * 2**20
# A time finding that costs a quarter of every step or more is critical: a 1.33x speed-up waits behind it.
CRITICAL_STEP_SHARE = 0.25


def worth_time(cost_ms: float, step_ms: float | None) -> bool:
    """Whether a cost of ``cost_ms`` per step clears TIME_FLOOR_MS and STEP_SHARE_FLOOR of a ``step_ms`` step."""
    if not step_ms or pd.isna(cost_ms) or pd.isna(step_ms):
        return False
    return cost_ms >= TIME_FLOOR_MS and cost_ms / step_ms >= STEP_SHARE_FLOOR


def critical_or(grade: str, cost_ms: float, step_ms: float | None) -> str:
    """A time finding's severity: critical where its cost is CRITICAL_STEP_SHARE of the step or more, else ``grade``
    (the finding's own)."""
    return "critical" if step_ms and cost_ms >= CRITICAL_STEP_SHARE * step_ms else grade


def critical_share_or(grade: str, share: float) -> str:
    """critical_or for a cost already stated as a share of the step."""
    return "critical" if share >= CRITICAL_STEP_SHARE else grade


def worth_bytes(cost_bytes: float) -> bool:
    """Whether a memory difference clears MEMORY_FLOOR_BYTES."""
    return bool(pd.notna(cost_bytes) and cost_bytes >= MEMORY_FLOOR_BYTES)


def total_text(total_ms: float) -> str:
    """A time over the run: "4.91 ms", "0.35 s", "3.6 s"; under 10 ms in ms (two decimals of a second would read
    0.00 s or 0.01 s)."""
    total_s = total_ms / 1e3
    return f"{total_ms:.2f} ms" if total_s < 0.01 else f"{total_s:,.{1 if total_s >= 1 else 2}f} s"


def cost_text(ms_per_step: float, steps: int, whose: str = "the run's") -> str:
    """"costs 1.20 ms a step, 3.6 s over the run's 3,000 steps" (``whose``: "rank:1's", for a rank with fewer)."""
    return f"costs {ms_per_step:.2f} ms a step, {total_text(ms_per_step * steps)} over {whose} {steps:,} steps"


@dataclass(frozen=True)
class Imbalance:
    """How much the slowest device holds the others up, over a table of per-step times (steps x devices)."""

    slowest: str
    fastest: str
    medians: pd.Series  # each device's median ms per step
    ratio: float  # the slowest device's median over the median of the others' medians
    slowest_share: float  # share of steps in which the slowest device was the slowest
    excess_ms: pd.Series  # per step, the slowest device's time less each other's (at least 0), averaged over the others
    steps: int

    @property
    def others_ms(self) -> float:
        """The median of the other devices' medians: the figure the slowest is compared with."""
        return float(self.medians.drop(self.slowest).median())

    @property
    def wait_ms_per_step(self) -> float:
        """How long the others wait for the slowest device a step: its median less the others' (the difference of
        the bars a page draws), the one figure the headline, the finding and every page state."""
        return float(self.medians[self.slowest]) - self.others_ms


def imbalance(table: pd.DataFrame) -> Imbalance | None:
    """The one definition of a device's imbalance, for the findings and the Overview alike.

    Args:
        table: ms per step (rows, the first step left out: it carries one-time costs) and device (columns); a device
            absent from a step (a rank done early under Join, or profiled over fewer steps) is NaN there.

    Returns:
        None with fewer than two devices or three steps of two devices or more; each device's median is over the
        steps it has.
    """
    table = table.dropna(thresh=2)
    if table.shape[1] < 2 or len(table) < 3:
        return None
    medians = table.median()
    slow = medians.idxmax()
    others = medians.drop(slow)
    ratio = float(medians[slow] / others.median()) if others.median() else float("inf")
    excess = table.drop(columns=slow).rsub(table[slow], axis=0).clip(lower=0).mean(axis=1)
    return Imbalance(slowest=str(slow), fastest=str(medians.idxmin()), medians=medians, ratio=ratio,
                     slowest_share=float((table.idxmax(axis=1) == slow).mean()), excess_ms=excess, steps=len(table))
