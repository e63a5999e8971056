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

__all__ = ["damage_of", "job_of", "model_of"]


def model_of(run: StoredRun) -> RunModel:
    """The run's model (its kind, devices, measurements): what every page's header and sections start from."""
    return run.model


def damage_of(run: StoredRun) -> list[str]:
    """What was wrong in the run's files and left out, one line each (StoredRun.damage); [] for a sound run."""
    return run.damage


def job_of(run: StoredRun) -> str | None:
    """The distributed job an imported trace belongs to, from its ``distributedInfo``: "rank 0 of 128 (nccl)",
    "ranks 0, 1 of 128 (nccl)"; None for a run that is no part of one (a recorded run, a one-process trace)."""
    meta = run.meta
    args = meta.get("workload_args") or {}
    info = args.get("distributedInfo") if isinstance(args, dict) else None
    world = meta.get("world_size") or (info.get("world_size") if isinstance(info, dict) else None)
    if not model_of(run).imported or not world:
        return None
    ranks = meta.get("ranks") or ([meta["rank"]] if meta.get("rank") is not None else [])
    backend = info.get("backend") if isinstance(info, dict) else None
    which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)} of " if ranks else ""
    return f"{which}a {int(world):,}-rank job" + (f" ({backend})" if backend else "")

