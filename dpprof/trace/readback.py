"""dpprof's own trace files read back exactly (``dpprof import`` of a file ``dpprof export --trace`` wrote).

A trace torch.profiler writes says nothing of which device a thread served, so the importer infers it (the k-th
``dpprof.apply`` in a ``parallel_apply`` is device k; a DDP rank's phases come from torch's own ranges). A file
dpprof wrote names it: its metadata (``dpprofExport``, and ``dpprofThreads`` at the end of the file) lists the
run's devices and the device each thread id belongs to. Read back, each ``dpprof.<phase>`` slice is that phase on
that device, in the step whose ``ProfilerStep#N`` holds its end (a DDP rank's ``data`` phase begins in the gap
before its step); forward calls are not in the file (every phase reads as call 0), nor is dpprof's memory
accounting (its counters), so the run read back has its steps, phases, allocator figures and collectives, under
the name and workload of the run it was (``exported_identity``). An FSDP run's file (``dpprofExport.kind`` "fsdp")
reads back as an imported trace of FSDP with FSDP's phases (copy_in, all_gather_wait, copy_out, reduce_scatter_wait)
and its all-gathers and reduce-scatters.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from dpprof.records import PHASE_ORDER, PhaseRecord, Record
from dpprof.trace.collect import Collected
from dpprof.trace.decode import TraceError
from dpprof.trace.numbers import MAX_BYTES, MAX_GPU_INDEX, slack_us, whole

__all__ = ["EXPORT_KEY", "THREADS_KEY", "EXPORT_VERSION", "export_info", "exported_identity", "exported_gpus",
           "exported_inventory", "exported_phases"]

EXPORT_KEY = "dpprofExport"  # top-level field of a trace dpprof wrote: the run, its devices, the steps it holds
THREADS_KEY = "dpprofThreads"  # top-level field after traceEvents: thread id -> device (lanes are made as written)
EXPORT_VERSION = 1
_PHASE_NAMES = frozenset(PHASE_ORDER)  # every kind's phases: DataParallel's, DDP's and FSDP's


def export_info(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The metadata dpprof wrote into a trace it exported, or None for a trace dpprof did not write."""
    info = meta.get(EXPORT_KEY)
    if not isinstance(info, dict) or not isinstance(meta.get(THREADS_KEY), dict):
        return None
    return info


def exported_identity(meta: dict[str, Any]) -> dict[str, str | None]:
    """The name and workload of the run a file dpprof exported holds (``dpprofExport.name``, ``.workload``), so that
    it reads back as a run of the same job (Compare pairs it with its original): each the file gives, as text or
    null (a run that named no workload reads back naming none); {} for a trace dpprof did not write, and no
    workload in one written before dpprof wrote it."""
    info = export_info(meta) or {}
    return {key: info[key] or None for key in ("name", "workload")
            if key in info and (info[key] is None or isinstance(info[key], str))}


def exported_gpus(info: dict[str, Any]) -> dict[str, int]:
    """The file's GPUs: device -> its CUDA index (``dpprofExport.gpus``: a rank's GPU, whose file may hold no kernel
    and no ``[memory]`` event to show it), for its deviceProperties; {} in a file without them."""
    gpus = info.get("gpus")
    if not isinstance(gpus, dict):
        return {}
    return {str(d): g for d, g in gpus.items()
            if isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= MAX_GPU_INDEX}


# The inventory's figures a file dpprof exported carries (``dpprofExport.inventory``), DeviceRecord's: text, or whole
# numbers up to a bound; and a device with no GPU in the trace its kind, a CPU worker's or a DDP or FSDP rank's (a GPU
# is "cuda" as the importer reads it from the trace, a rank's GPU too)
_HOST_KINDS = ("cpu", "rank")
_INVENTORY_TEXT = ("name", "capability", "pci_bus_id", "cpu_model")
_INVENTORY_WHOLE = {"total_memory_bytes": MAX_BYTES, "multiprocessor_count": MAX_GPU_INDEX, "nvml_index": MAX_GPU_INDEX,
                    "cores": MAX_GPU_INDEX, "threads": MAX_GPU_INDEX}


def exported_inventory(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each device's inventory figures in a file dpprof exported (``dpprofExport.inventory``: a CPU worker's model,
    cores and threads, a GPU's PCI bus and NVML index, which Kineto's deviceProperties do not hold), by device; a
    figure of the wrong type or out of range is unknown, left out; {} in a file without them."""
    rows = info.get("inventory")
    out: dict[str, dict[str, Any]] = {}
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("device"), str) or row["device"] in out:
            continue
        known: dict[str, Any] = {k: row[k] for k in _INVENTORY_TEXT if isinstance(row.get(k), str)}
        if row.get("kind") in _HOST_KINDS:
            known["kind"] = row["kind"]
        known.update({k: n for k, hi in _INVENTORY_WHOLE.items() if (n := whole(row.get(k), 0, hi)) is not None})
        out[row["device"]] = known
    return out


def exported_phases(c: Collected, windows: list[tuple[int, float, float]],
                    ms: Callable[[float], float]) -> tuple[list[str], list[Record]]:
    """The devices (in the run's order) and phases of a trace dpprof exported.

    Raises:
        TraceError: the file holds several ranks of a distributed run (``--one-file``, for viewing): their
            steps would be counted once per rank; the per-rank files import as ranks.
    """
    info = c.meta[EXPORT_KEY]
    ranks = info.get("ranks") if isinstance(info.get("ranks"), list) else []  # another type: not dpprof's, none
    if len(ranks) > 1:
        raise TraceError(f"{c.name}: holds {len(ranks)} ranks of a distributed run in one file (dpprof export "
                         "--one-file, for viewing): import the per-rank files dpprof export writes without --one-file")
    device_of = {str(tid): str(device) for tid, device in c.meta[THREADS_KEY].items()}
    devices = [str(d) for d in info.get("devices")] if isinstance(info.get("devices"), list) else []
    starts = [w[1] for w in windows]
    out: list[Record] = []
    for r in c.dpprof_ranges:
        device = device_of.get(str(r.tid))
        if device is None or r.name not in _PHASE_NAMES or not windows:
            continue
        # the last step to begin before the phase ended (an end at a step's start, but for ts + dur's rounding, is
        # before it)
        i = max(0, bisect.bisect_left(starts, r.end_us - slack_us(r.end_us)) - 1)
        out.append(PhaseRecord(step=windows[i][0], call=0, phase=r.name, device=device, start_ms=ms(r.start_us),
                               duration_ms=(r.end_us - r.start_us) / 1e3))
        if device not in devices:
            devices.append(device)
    return devices, out
