"""What each dashboard page (and ``dpprof show``) shows, as DataFrames and sentences, one module per page:

| module | page |
| --- | --- |
| dpprof.views.overview | Overview: each device at a glance, step time, phases, the kind's own section, findings |
| dpprof.views.load | Per-GPU load: work distributions, memory, chunks, GPUs over time, GPU time |
| dpprof.views.timeline | Timeline: phases per device over a range of steps |
| dpprof.views.compare | Compare: runs side by side |
| dpprof.views.export | Export: CSVs and the run as a zip |
| dpprof.views.text | tables and labels as people read them |

Composed from the store's queries, the run's model and the findings. No Streamlit here (the app caches and
lays these out), no plotting (dpprof.charts draws them). Pages are handed these functions, not their names.

Example:
    >>> from dpprof.views import overview
    >>> data = overview.overview(dpprof.load_run("20261122-080557"))
    >>> charts.step_times(data.steps)
"""
from __future__ import annotations

from dpprof.store.model import RunModel
from dpprof.store.reader import StoredRun

__all__ = ["model_of"]


def model_of(run: StoredRun) -> RunModel:
    """The run's model (its kind, devices, measurements): what every page's header and sections start from."""
    return run.model
