"""The Per-GPU load page of one run: each device's work as a distribution, its memory, its chunks, its GPU over
time (NVML) and its GPU time by what ran (imported traces)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from dpprof.store import queries
from dpprof.store.model import RunModel
from dpprof.store.reader import StoredRun

__all__ = ["Load", "load"]


@dataclass
class Load:
    """The Per-GPU load page of one run. A section the run has no data for is absent from its frames and
    said in ``missing`` (measurement -> one sentence), never drawn empty."""

    model: RunModel
    work_samples: pd.DataFrame  # queries.work_samples
    work_stats: pd.DataFrame  # queries.work_stats
    memory: pd.DataFrame  # queries.memory_peaks
    chunks: pd.DataFrame  # queries.chunk_counts, calls without a batch left out (DataParallel runs only)
    gpu: pd.DataFrame  # queries.gpu_series
    gpu_time: pd.DataFrame  # queries.gpu_time (imported traces with GPUs)
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def idle(self) -> list[str]:
        return list(self.model.idle)


def load(run: StoredRun) -> Load:
    """Work distributions, memory, chunk sizes and GPU samples per device of one run."""
    model = run.model
    samples = queries.work_samples(run)
    chunks = queries.chunk_counts(run) if model.dataparallel else pd.DataFrame(columns=["device", "chunk_size", "calls"])
    memory = queries.memory_peaks(run, chunks)
    data = Load(model=model, work_samples=samples, work_stats=queries.work_stats(run, samples), memory=memory,
                chunks=chunks.dropna(subset=["chunk_size"]).reset_index(drop=True), gpu=queries.gpu_series(run),
                gpu_time=queries.gpu_time(run))
    missing = {k: v for k, v in model.missing.items() if k in ("work", "gpu_samples", "gpu_time")}
    if memory.empty:
        missing["memory"] = " ".join(v for k, v in model.missing.items() if k in ("memory", "allocator"))
    elif "allocator" in model.missing and "memory" in model.has:
        missing["allocator"] = model.missing["allocator"]
    elif "memory" in model.missing:  # an imported trace: the allocator's peaks only
        missing["memory_accounting"] = (model.missing["memory"] + " The markers are the CUDA allocator's peak "
                                        "allocated and reserved bytes from its [memory] events.")
    data.missing = missing
    return data
