"""Which steps keep their full detail in a run file, so that a day-long run stays small.

Every step's duration is kept (the steps table stays whole), and every record is counted into per-block
aggregates (dpprof.store.blocks). Full detail (each phase, memory, allocator and all-reduce row) is kept
for:

- the first ``first_steps`` steps (warm-up, and every short run whole);
- one step in every ``every`` (a systematic sample: medians, shares and distributions read from these
  steps are unbiased);
- outlier steps (over OUTLIER_RATIO x the run's median step so far; at most ``outliers_per_chunk`` of the
  slowest per ``chunk_steps`` steps) and the steps either side of each;
- each device's peak step (the most dpprof accounts to it, and the allocator's peak), as long as it is
  the peak;
- the most recent ``last_steps`` steps.

NVML samples (time-based, not per step) are kept whole for the first ``samples_full_s`` seconds, then as one
row per GPU per ``sample_window_s`` seconds holding the window's means (maxima of the memory figures, the
union of throttle reasons).

The writer writes every row as it comes (a crash keeps everything committed) and, once a chunk of steps is
``last_steps`` behind the newest, deletes the rows of its steps that none of these reasons keep.
``Retention(mode="all")`` keeps every row (``dpprof.record(detail="all")``, ``--detail all``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DETAIL_MODES", "OUTLIER_RATIO", "Retention", "BOUNDED", "ALL", "retention_of", "DETAIL_TABLES"]

DETAIL_MODES = ("bounded", "all")
# A step over twice the median so far is an outlier: the findings' own rule (dpprof.findings.steps'
# OUTLIER_STEP_RATIO), applied as steps arrive.
OUTLIER_RATIO = 2.0
# The record tables whose rows are per step detail (the steps table is always whole).
DETAIL_TABLES = ("phases", "memory", "allocator", "comms")


@dataclass(frozen=True)
class Retention:
    """How much detail a run keeps (see the module's docstring). The defaults are dpprof's."""

    mode: str = "bounded"  # "bounded" | "all"
    first_steps: int = 1000
    last_steps: int = 1000
    every: int = 100  # one step in every this many keeps full detail
    chunk_steps: int = 1000  # steps decided together: the outlier quota's unit, and the unit of deletion
    outliers_per_chunk: int = 2  # a stall every few hundred steps is told; a noisy machine's many are not all kept
    block_steps: int = 100  # steps per aggregate block (dpprof.store.blocks)
    # NVML samples: every one for the first samples_full_s seconds, then one per device per sample_window_s (the
    # window's means; maxima of memory; the union of throttle reasons): 10 Hz on 8 GPUs is 6.9 million rows a day
    samples_full_s: float = 600.0
    sample_window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in DETAIL_MODES:
            raise ValueError(f"detail must be one of {', '.join(DETAIL_MODES)}, got {self.mode!r}")
        for name in ("first_steps", "last_steps", "every", "chunk_steps", "block_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Retention.{name} must be at least 1, got {getattr(self, name)}")
        if not self.sample_window_s > 0 or self.samples_full_s < 0:
            raise ValueError(f"Retention.sample_window_s must be positive and samples_full_s not negative, got "
                             f"{self.sample_window_s} and {self.samples_full_s}")

    @property
    def bounded(self) -> bool:
        return self.mode == "bounded"

    def sampled(self, step: int) -> bool:
        """Whether ``step`` keeps full detail as one of the first steps or the one-in-``every`` sample."""
        return step < self.first_steps or step % self.every == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


BOUNDED = Retention()
ALL = Retention(mode="all")


def retention_of(detail: str | Retention | None) -> Retention:
    """``dpprof.record``'s ``detail`` argument as a Retention: "bounded" (the default), "all", or one given."""
    if detail is None or detail == "bounded":
        return BOUNDED
    if detail == "all":
        return ALL
    if isinstance(detail, Retention):
        return detail
    raise ValueError(f"detail must be one of {', '.join(DETAIL_MODES)}, got {detail!r}")


def stored_retention(value: Any) -> Retention | None:
    """The Retention a run file stores in runs.detail (None: a file written before retention existed)."""
    if not value:
        return None
    fields = json.loads(value) if isinstance(value, str) else dict(value)
    return Retention(**{k: v for k, v in fields.items() if k in Retention.__dataclass_fields__})
