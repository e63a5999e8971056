"""The Memory page of one run: allocated and reserved memory over time per device (stored bucketed to
dpprof.trace.detail.MEMORY_POINTS points a device, each a bucket's maximum, like the step charts), each device's
peak and the step it fell in, the memory events (allocations paired with their frees) and memory per operator."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.store import detail_rows
from dpprof.store.reader import StoredRun
from dpprof.units import bytes_unit
from dpprof.views.opdiff import Pick

__all__ = ["MEMORY_EVENTS_SHOWN", "MemoryPage", "memory_page", "picks", "missing_text", "memory_curve", "peaks", "peak_lines", "events", "per_operator"]

MEMORY_EVENTS_SHOWN = 1_000  # the largest allocations in the table: a browser shows a thousand rows at once


def missing_text(run: StoredRun) -> str | None:
    """Why the run has no memory over time and what to do (one sentence), or None where it has it."""
    why = detail_rows.detail_missing(run)
    if why is not None:
        return why[0].upper() + why[1:] + "."
    if detail_rows.memory_peaks(run).empty:
        if run.meta.get("source") == "trace":
            return ("No memory over time: this trace has no [memory] events (profile with "
                    "torch.profiler.profile(profile_memory=True) and import it again).")
        return ("No memory over time: the deep capture's trace holds no [memory] events for this run's devices "
                "(torch.profiler writes none when it profiles every thread, as for DataParallel's replicas; a DDP "
                "or FSDP rank's capture has them, as does a trace profiled with profile_memory=True and imported: "
                "dpprof import FILE).")
    return None


def memory_curve(run: StoredRun, pick: Pick) -> pd.DataFrame:
    """Allocated and reserved bytes over time per rank and device (detail_rows.memory_timeline), with a
    ``series`` column naming each line ("cuda:0" or "rank 1 cuda:0" where the run has several ranks)."""
    df = detail_rows.memory_timeline(run, rank=pick.rank, device=pick.device)
    many = df["rank"].nunique() > 1
    df["series"] = [f"rank {r} {d}" if many else str(d) for r, d in zip(df["rank"], df["device"])]
    return df


def peaks(run: StoredRun, pick: Pick) -> pd.DataFrame:
    """Each device's peak allocated and reserved bytes, when (ms from the run's start) and in which step."""
    df = detail_rows.memory_peaks(run, rank=pick.rank, device=pick.device)
    for col in ("peak_allocated_bytes", "peak_reserved_bytes"):  # NaN where the trace has no reserved figure
        df[col] = df[col].astype(float)
    return df


def peak_lines(df: pd.DataFrame) -> list[str]:
    """"cuda:0 peaks at 55.1 MiB allocated in step 6, 244.7 ms into the run", one line a device of ``peaks``."""
    lines = []
    for row in df.itertuples(index=False):
        unit, scale = bytes_unit(float(row.peak_allocated_bytes))
        where = f"in step {int(row.peak_step)}" if pd.notna(row.peak_step) else "outside every step"
        what = "allocated (the running sum of the trace's allocations)" if row.cumulative else "allocated"
        lines.append(f"{row.device} peaks at {row.peak_allocated_bytes * scale:,.1f} {unit} {what} {where}, "
                     f"{row.peak_t_ms:,.1f} ms into the run.")
    return lines


def events(run: StoredRun, pick: Pick, top: int = MEMORY_EVENTS_SHOWN) -> pd.DataFrame:
    """The ``top`` largest allocations with their operator, size, times and lifetime, in time order."""
    return detail_rows.memory_events(run, rank=pick.rank, device=pick.device, top=top)


def per_operator(run: StoredRun, pick: Pick) -> pd.DataFrame:
    """Per operator: calls, allocations, bytes allocated and freed, size increase (detail_rows.operator_memory)."""
    return detail_rows.operator_memory(run, rank=pick.rank, device=pick.device)


def picks(run: StoredRun) -> list[Pick]:
    """Every (rank, device) with memory over time (the rank None in a run of one rank)."""
    pairs = detail_rows.memory_peaks(run)[["rank", "device"]].drop_duplicates().sort_values(["rank", "device"])
    one = pairs["rank"].nunique() <= 1
    return [Pick(None if one else int(r), str(d)) for r, d in pairs.itertuples(index=False, name=None)]


@dataclass
class MemoryPage:
    """What the Memory page shows for one pick, read in one go."""

    peaks: pd.DataFrame
    curve: pd.DataFrame
    events: pd.DataFrame
    per_operator: pd.DataFrame


def memory_page(run: StoredRun, pick: Pick) -> MemoryPage:
    """The Memory page's data for a pick."""
    return MemoryPage(peaks=peaks(run, pick), curve=memory_curve(run, pick), events=events(run, pick),
                      per_operator=per_operator(run, pick))
