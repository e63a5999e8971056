"""What would switching buy: predictions of other set-ups from one recorded DataParallel run.

| module | what | imports torch |
| --- | --- | --- |
| dpprof.advise.measured | the recorded run's figures the model needs (typical step, phases, chunks, memory) | no |
| dpprof.advise.calibration_cache | this machine's measured costs (hand-off, copies, all-reduce), cached per host and device set | no |
| dpprof.advise.predict | the arithmetic: each scenario's step time, its parts and interval, memory per device | no |
| dpprof.advise.commands | the command that runs each scenario for real | no |
| dpprof.advise.calibrate | the calibration itself (CPU workers, gloo ranks) | yes |
| dpprof.advise.compute | the run's own model measured alone on each split of its batch, cached per run | only measure_compute |
| dpprof.advise.check | runs each scenario's command and reads the run it recorded | no (its subprocesses do) |

The read side (dpprof.views.advise, the Advisor page) reads a cached calibration and never measures.
"""
from __future__ import annotations

__all__ = ["NotAdvisable"]


class NotAdvisable(Exception):
    """A run the advisor cannot predict from; the message says why in one line."""
