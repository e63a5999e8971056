"""Rules over the steps alone, for every kind of run: steps that stall far beyond the median."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.findings.base import MEDIAN_STEP, Tables, finding
from dpprof.findings.floors import worth_time

__all__ = ["OUTLIER_STEP_RATIO", "OUTLIER_TIME_SHARE", "OUTLIER_WARN_SHARE", "OUTLIER_STEPS_LISTED", "Stalls", "stalls",
           "outlier_steps"]

# A step (past the first) over 2x the run's median step is an outlier: a stall or contention from
# outside the step (another process on the same cores or GPU, data loading, swapping), not the
# model's own variation, which stays well within 2x on a steady machine ...
OUTLIER_STEP_RATIO = 2.0
# ... worth a finding when the outliers' time beyond the median is over 5% of the run's step time ...
OUTLIER_TIME_SHARE = 0.05
# ... and a warning from 20%: a fifth of the run then went to stalls, enough to distort every other figure.
OUTLIER_WARN_SHARE = 0.20
# Outlier steps listed in the evidence (the slowest first).
OUTLIER_STEPS_LISTED = 8


@dataclass(frozen=True)
class Stalls:
    """Steps far beyond the run's median, as the stall rule counts them (outlier_steps raises its finding on these;
    dpprof advise says them before any prediction)."""

    median_ms: float  # the median of the steps past the first
    slow_ms: pd.Series  # step -> ms of each step over OUTLIER_STEP_RATIO x the median, the slowest first
    excess_ms: float  # their time beyond the median, summed
    share: float  # excess_ms over the run's step time (steps past the first)
    steps: int  # steps past the first

    @property
    def severity(self) -> str:
        return "warning" if self.share >= OUTLIER_WARN_SHARE else "info"


def stalls(step_ms: pd.Series) -> Stalls | None:
    """The stall rule over the steps past the first (ms by step, in step order): steps over OUTLIER_STEP_RATIO x
    the median whose time beyond it is over OUTLIER_TIME_SHARE of the run's and clears the time floors; None
    where there are none (or fewer than 3 steps)."""
    if len(step_ms) < 3:
        return None
    median = float(step_ms.median())
    slow = step_ms[step_ms > OUTLIER_STEP_RATIO * median]
    excess = float((slow - median).sum())
    share = excess / float(step_ms.sum()) if step_ms.sum() else 0.0
    if slow.empty or share < OUTLIER_TIME_SHARE or not worth_time(excess / len(step_ms), median):
        return None
    return Stalls(median, slow.sort_values(ascending=False), excess, share, len(step_ms))


def outlier_steps(t: Tables) -> list[dict]:
    """Steps far beyond the run's median (stalls, contention from other load), named with their times."""
    per = t.every_step.groupby("step")["duration_ms"].max().sort_index().iloc[1:]  # the first step's costs are no stall
    found = stalls(per)
    if found is None:
        return []
    median, excess, share, worst = found.median_ms, found.excess_ms, found.share, found.slow_ms
    listed = ", ".join(f"{s} ({ms:.0f} ms)" for s, ms in worst.head(OUTLIER_STEPS_LISTED).items())
    more = f" and {len(worst) - OUTLIER_STEPS_LISTED} more" if len(worst) > OUTLIER_STEPS_LISTED else ""
    return [finding("outlier_steps", found.severity, None,
                    f"{len(worst)} of {found.steps} steps took over {OUTLIER_STEP_RATIO:g}x the median step",
                    f"{MEDIAN_STEP} {median:.2f} ms; steps {listed}{more}; {excess / 1e3:.2f} s beyond the median, "
                    f"{share:.0%} of the run's step time past the first",
                    "Steps that stall like this come from outside the model: another process on the same cores or "
                    "GPU (another run started alongside), data loading, swapping or garbage collection. Check what "
                    "else ran at those steps; the per-device findings of such a run are less certain.", share, "share")]
