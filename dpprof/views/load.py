"""The Per-GPU load page of one run: each device's work as a distribution, its memory, its chunks, its GPU over
time (NVML) and its GPU time by what ran (imported traces).

Each section belongs to some kinds of run: chunk sizes to DataParallel, the GPU sections to runs with GPUs, the
output device to a run that gathers outputs onto one. A section of another kind is absent, not drawn empty; a
measurement the run's kind could have but lacks is said once, in ``missing``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from dpprof.store import queries
from dpprof.store.model import RunModel
from dpprof.store.reader import StoredRun
from dpprof.units import mib

__all__ = ["Load", "load", "has_gpus"]


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
    gpus: bool = False  # whether the run ran on GPUs: the GPU sections belong to its kind

    @property
    def idle(self) -> list[str]:
        return list(self.model.idle)

    @property
    def memory_table(self) -> pd.DataFrame:
        """The memory table in the run's terms: no output-device column where nothing is gathered onto one
        device (DDP ranks, imported traces, the balanced model), no column of a measurement the run lacks."""
        table = self.memory if self.model.gathers else self.memory.drop(columns=["output_device"], errors="ignore")
        return table.dropna(axis=1, how="all")

    @property
    def memory_chart(self) -> bool:
        """Whether memory is drawn: to set devices side by side, or one device's bytes by kind (dpprof's
        accounting); one device's allocator peaks alone are said in words (``memory_text``), not drawn as one
        marker."""
        return len(self.memory) > 1 or "memory" in self.model.has

    @property
    def memory_text(self) -> str:
        """One device's CUDA allocator peaks in words (where ``memory_chart`` is False)."""
        out = []
        for row in self.memory.itertuples():
            figures = [f"{mib(float(value))} {what}" for what in ("allocated", "reserved")
                       if (value := getattr(row, f"peak_{what}_bytes", None)) is not None and pd.notna(value)]
            if figures:
                out.append(f"{row.device}'s CUDA allocator peaked at {' and '.join(figures)}.")
        return " ".join(out)


def has_gpus(model: RunModel) -> bool:
    """Whether a run ran on GPUs, so GPU samples and GPU time are measurements of its kind (absent from a run on
    CPU workers, CPU ranks or a CPU-only trace, whose pages leave the GPU sections out)."""
    return (model.backend == "cuda" or model.kind == "trace_gpu"
            or bool({"gpu_samples", "gpu_time", "allocator"} & model.has))


def load(run: StoredRun) -> Load:
    """Work distributions, memory, chunk sizes and GPU samples per device of one run."""
    model = run.model
    samples = queries.work_samples(run)
    chunks = queries.chunk_counts(run) if model.dataparallel else pd.DataFrame(columns=["device", "chunk_size", "calls"])
    memory = queries.memory_peaks(run, chunks)
    gpus = has_gpus(model)
    data = Load(model=model, work_samples=samples, work_stats=queries.work_stats(run, samples), memory=memory,
                chunks=chunks.dropna(subset=["chunk_size"]).reset_index(drop=True), gpu=queries.gpu_series(run),
                gpu_time=queries.gpu_time(run), gpus=gpus)
    # without GPUs, gpu_samples is the one sentence that says why the GPU sections are absent
    wanted = ("work", "gpu_samples", "gpu_time") if gpus else ("work", "gpu_samples")
    missing = {k: v for k, v in model.missing.items() if k in wanted}
    if memory.empty:
        missing["memory"] = " ".join(v for k, v in model.missing.items() if k in ("memory", "allocator"))
    elif "allocator" in model.missing and "memory" in model.has:
        missing["allocator"] = model.missing["allocator"]
    elif "memory" in model.missing:  # an imported trace: the allocator's peaks only
        missing["memory_accounting"] = (model.missing["memory"] + (" The markers are the CUDA allocator's peak "
                                        "allocated and reserved bytes from its [memory] events." if data.memory_chart
                                        else ""))
    data.missing = missing
    return data
