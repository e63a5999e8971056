"""The benchmarks' one interval: a statistic of paired rounds, the rounds resampled with replacement.

A round runs every arm once, in one process, so the machine's noise moves a round's arms alike; a resample keeps
each round's arms together. Seeded: the same rounds give the same interval.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable

__all__ = ["BOOTSTRAP", "interval", "median_interval"]

BOOTSTRAP = 2000  # resamples of the rounds for a 95% interval


def interval(rounds: int, stat: Callable[[list[int]], float]) -> tuple[float, float]:
    """The 95% interval of ``stat`` (given the indices of a resample of the rounds) over the rounds resampled."""
    rng = random.Random(0)
    values = sorted(stat(rng.choices(range(rounds), k=rounds)) for _ in range(BOOTSTRAP))
    return values[int(0.025 * BOOTSTRAP)], values[int(0.975 * BOOTSTRAP) - 1]


def median_interval(values: list[float]) -> tuple[float, float]:
    """The 95% interval of the median of per-round ``values``."""
    return interval(len(values), lambda idx: statistics.median(values[i] for i in idx))
