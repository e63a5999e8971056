"""The hardware a run uses: device inventory, and the pre-flight balance check before training."""
from __future__ import annotations

import operator
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dpprof.device_ids import DeviceLike, DeviceSet, resolve_devices
from dpprof.nvml import Nvml, NvmlUnavailable, throttle_names
from dpprof.records import (SEVERITIES, SLOWDOWN_REASONS, DeviceRecord, FindingRecord, finding_unit_error,
                            even_batch_sizes, idle_severity, split_shares, uneven_severity)
from dpprof.units import plural

__all__ = ["inventory", "check_balance", "chunk_sizes", "even_batch_sizes", "cpu_info",
           "MEMORY_RATIO_WARN", "MULTIPROCESSOR_RATIO_WARN", "FREE_MEMORY_RATIO_WARN"]

MEMORY_RATIO_WARN = 0.75  # torch's own _check_balance rule: less than 75% of another GPU's memory
MULTIPROCESSOR_RATIO_WARN = 0.75  # the same rule for streaming multiprocessors
FREE_MEMORY_RATIO_WARN = 0.75  # other processes leave this GPU under 75% of the best one's free memory


def cpu_info() -> dict[str, Any]:
    """CPU model, physical cores and hardware threads of this machine."""
    model, cores = None, set()
    try:
        physical = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key == "physical id":
                physical = value
            elif key == "core id":
                core = value
                cores.add((physical, core))
    except OSError:
        pass
    threads = os.cpu_count()
    return {"cpu_model": model, "cores": len(cores) or threads, "threads": threads}


def _bus_id(props: Any) -> str | None:
    if getattr(props, "pci_bus_id", None) is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"


def _nvml() -> tuple[Nvml | None, str | None]:
    try:
        return Nvml(), None
    except NvmlUnavailable as err:
        return None, str(err)


def nvml_handles(nvml: Nvml, indices: Sequence[int]) -> dict[str, Any]:
    """torch's cuda:N -> NVML handle, joined by PCI bus id (CUDA_VISIBLE_DEVICES reorders torch's indices)."""
    handles = {}
    for i in indices:
        bus = _bus_id(torch.cuda.get_device_properties(i))
        label = f"cuda:{i}"
        handle = nvml.get(label, "handle", nvml.handle_by_bus_id, bus) if bus else None
        if handle is not None:
            handles[label] = handle
    return handles


def inventory(devices: DeviceSet, nvml: Nvml | None = None) -> list[DeviceRecord]:
    """One DeviceRecord per device of ``devices``: torch's properties joined to NVML for CUDA."""
    if devices.type in ("cpu", "rank"):
        info = cpu_info()
        name = "CPU worker thread" if devices.type == "cpu" else f"rank on {socket.gethostname()}"
        return [DeviceRecord(device=label, kind=devices.type, name=name, **info) for label in devices.labels]
    nvml_index = {}
    if nvml is not None:
        for j in range(nvml.get("nvml", "device count", nvml.count) or 0):
            handle = nvml.get(f"nvml:{j}", "handle", nvml.handle_by_index, j)
            bus = handle is not None and nvml.get(f"nvml:{j}", "PCI info", nvml.bus_id, handle)
            if bus:
                nvml_index[bus] = j
    records = []
    for i in devices.indices:
        props = torch.cuda.get_device_properties(i)
        bus = _bus_id(props)
        records.append(DeviceRecord(
            device=f"cuda:{i}", kind="cuda", name=props.name, total_memory_bytes=int(props.total_memory),
            multiprocessor_count=int(props.multi_processor_count), capability=f"{props.major}.{props.minor}",
            pci_bus_id=bus, nvml_index=nvml_index.get(bus.upper()) if bus else None,
        ))
    return records


MAX_BATCH_SIZE = 2**40  # samples: past any device's memory, and well inside torch's sizes


def chunk_sizes(batch_size: int, n_devices: int) -> list[int]:
    """The chunk each device gets, exactly as torch.chunk splits a batch (devices past the end idle)."""
    return [len(c) for c in torch.empty(batch_size, 0).chunk(n_devices)]


def _finding(kind: str, severity: str, device: str | None, title: str, evidence: str, advice: str,
             value: float | None = None, unit: str | None = None) -> FindingRecord:
    why = finding_unit_error(value, unit)
    if why is not None:
        raise ValueError(why)
    return FindingRecord(kind=kind, severity=severity, device=device, title=title, evidence=evidence,
                         advice=advice, value=value, unit=unit)


def _ratio_rule(devices: DeviceSet, values: dict[int, float], what: str, kind: str, threshold: float,
                unit: str) -> list[FindingRecord]:
    weak = min(values, key=values.__getitem__)
    strong = max(values, key=values.__getitem__)
    ratio = values[weak] / values[strong] if values[strong] else 1.0
    if ratio >= threshold:
        return []
    keep = [i for i in devices.indices if values[i] / values[strong] >= threshold]
    return [_finding(
        kind, "critical", f"cuda:{weak}",
        f"cuda:{weak} has {ratio:.0%} of the {what} of cuda:{strong}",
        f"{what}: cuda:{weak} {values[weak]:,.0f} {unit}, cuda:{strong} {values[strong]:,.0f} {unit} "
        f"(torch warns below {threshold:.0%})",
        f"DataParallel gives every device an equal chunk, so cuda:{weak} sets the pace. Use "
        f"device_ids={keep} (or CUDA_VISIBLE_DEVICES) without it.",
        ratio, "ratio")]


def _batch_rule(devices: DeviceSet, batch_size: int) -> list[FindingRecord]:
    n = len(devices.indices)
    sizes = chunk_sizes(batch_size, n)
    if len(sizes) == n and len(set(sizes)) == 1:
        return []
    idle = n - len(sizes)
    uneven, idle_share = split_shares(sizes, n)
    # what the split leaves unused of the step, which waits for a device with the biggest chunk: torch.chunk's biggest
    # chunk, ceil(batch / n), is the smallest any split of whole samples makes, so the same batch gains nothing from
    # another split; a batch n divides evenly fills every device (split_shares: the run's findings of the same split
    # state the same shares)
    biggest = max(sizes)
    evidence = (f"batch {batch_size} on {n} devices: torch.chunk gives {sizes}"
                + (f"; {idle} device(s) get nothing" if idle else "")
                + f"; every step waits for a device with the biggest chunk, {plural(biggest, 'sample')}, in which the "
                f"{n} devices could take {n * biggest} and are given {batch_size}: "
                + (f"the idle device(s) leave {idle_share:.0%} of the devices' time unused" if idle else
                   f"the uneven chunks leave {uneven:.0%} of the devices' time unused")
                + (f" (the uneven chunks given, {uneven:.0%} more)" if idle and uneven else "")
                + f"; no split of {plural(batch_size, 'sample')} gives a smaller biggest chunk")
    suggestions = even_batch_sizes(batch_size, n)
    advice = f"Use a batch size that {n} divides evenly: {' or '.join(map(str, suggestions))}."
    if idle:
        return [_finding("idle_devices", idle_severity(idle, n),
                         devices.label(devices.indices[len(sizes)]),
                         f"{idle} of {n} devices will idle at batch size {batch_size}", evidence, advice, idle_share,
                         "share")]
    return [_finding("uneven_chunks", uneven_severity(sizes, n), devices.label(devices.indices[-1]),
                     f"batch {batch_size} splits unevenly over {n} devices", evidence, advice, uneven, "share")]


def check_balance(device_ids: Sequence[DeviceLike] | None = None, batch_size: int | None = None,
                  nvml: Nvml | None = None) -> list[FindingRecord]:
    """The pre-flight check: will these devices (and this batch size) train in balance?

    Args:
        device_ids: the devices DataParallel will use (default: every visible GPU).
        batch_size: the batch size to check the torch.chunk split of.
        nvml: an open NVML session (default: open one if nvidia-ml-py and a driver are present).

    Returns:
        findings, worst first; empty when nothing stands out.

    Raises:
        TypeError: ``batch_size`` is no whole number (10.0, True).
        ValueError: ``batch_size`` is under 1 or past MAX_BATCH_SIZE.

    Example:
        >>> findings = dpprof.check_balance([0, 1, 2], batch_size=30)
    """
    if batch_size is not None:  # an int, or one like numpy's; never a float or a bool
        try:
            if isinstance(batch_size, bool):
                raise TypeError
            batch_size = operator.index(batch_size)
        except TypeError:
            raise TypeError(f"batch size must be a whole number (an int), got {batch_size!r}") from None
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    if batch_size is not None and batch_size > MAX_BATCH_SIZE:  # torch.chunk's sizes are 64-bit: no batch is near
        raise ValueError(f"batch size {batch_size:,} is past any batch a device holds (at most {MAX_BATCH_SIZE:,})")
    if device_ids is None:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            # a batch size given is not checked (there are no devices to split it over): said, not dropped
            unchecked = (f" Batch size {batch_size} was not checked: there are no devices to split it over."
                         if batch_size is not None else "")
            return [_finding("no_gpu", "critical", None, "no CUDA GPU is visible",
                             f"torch.cuda.is_available() is False (torch {torch.__version__}, "
                             f"CUDA {torch.version.cuda or 'none'})",
                             "Check the driver, CUDA_VISIBLE_DEVICES and that torch is a CUDA build; "
                             "or check CPU workers with --device-ids cpu:0,cpu:1." + unchecked)]
        device_ids = list(range(torch.cuda.device_count()))
    devices = resolve_devices(device_ids)
    findings: list[FindingRecord] = []
    if devices.type == "cpu":
        info = cpu_info()
        n = len(devices.indices)
        if info["threads"] and n > info["threads"]:
            findings.append(_finding(
                "oversubscribed_cpu", "warning", None, f"{n} CPU workers on {info['threads']} hardware threads",
                f"{n} worker threads, {info['cores']} cores, {info['threads']} threads",
                f"Workers beyond {info['threads']} only take turns; use at most {info['threads']}.", n, "count"))
    else:
        props = {i: torch.cuda.get_device_properties(i) for i in devices.indices}
        if len(props) > 1:
            findings += _ratio_rule(devices, {i: p.total_memory for i, p in props.items()},
                                    "total memory", "memory_imbalance", MEMORY_RATIO_WARN, "bytes")
            findings += _ratio_rule(devices, {i: p.multi_processor_count for i, p in props.items()},
                                    "multiprocessors", "multiprocessor_imbalance", MULTIPROCESSOR_RATIO_WARN, "SMs")
        own = nvml is None
        if nvml is None:
            nvml, _ = _nvml()
        if nvml is not None:
            try:
                findings += _nvml_rules(devices, nvml)
            finally:
                if own:
                    nvml.close()
    if batch_size is not None:
        findings += _batch_rule(devices, batch_size)
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])


_SEVERITY_ORDER = {severity: i for i, severity in enumerate(SEVERITIES)}  # worst first, as records says


def _nvml_rules(devices: DeviceSet, nvml: Nvml) -> list[FindingRecord]:
    findings = []
    handles = nvml_handles(nvml, devices.indices)
    lib = nvml.lib
    free, others = {}, {}
    for label, handle in handles.items():
        mem = nvml.get(label, "memory", lib.nvmlDeviceGetMemoryInfo, handle)
        if mem is not None:
            free[label] = mem.free
        others[label] = nvml.sample(handle, label, 0.0).other_process_memory_bytes or 0
        link = nvml.pcie_link(handle, label)
        known = {k: v for k, v in link.items() if v is not None}  # every figure NVML gave
        if len(known) == len(link) and (known["gen"] < known["max_gen"] or known["width"] < known["max_width"]):
            findings.append(_finding(
                "pcie_link_degraded", "warning", label,
                f"{label}'s PCIe link runs at gen {known['gen']} x{known['width']}",
                f"current gen {known['gen']} x{known['width']}, maximum gen {known['max_gen']} x{known['max_width']}",
                "Scatter and gather cross this link every step. Idle GPUs drop link speed to save power, so "
                "check under load; if it stays low, reseat the card or check the slot and BIOS settings."))
        mask = nvml.get(label, "throttle reasons", lib.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        if mask is not None:
            slow = [r for r in throttle_names(mask) if r in SLOWDOWN_REASONS]
            if slow:
                findings.append(_finding(
                    "throttled_now", "warning", label, f"{label} clocks are throttled ({', '.join(slow)})",
                    f"NVML clock-throttle reasons now: {', '.join(throttle_names(mask))}",
                    "A throttled GPU becomes the straggler: check cooling, power limits (nvidia-smi -q -d "
                    "PERFORMANCE) and other jobs on it.", len(slow), "count"))
    if len(free) > 1:
        best = max(free, key=free.__getitem__)
        for label, value in free.items():
            # smaller GPUs are the memory rule's business; this one is about other processes
            if free[best] and value / free[best] < FREE_MEMORY_RATIO_WARN and others[label]:
                findings.append(_finding(
                    "low_free_memory", "critical", label,
                    f"{label} has {value / free[best]:.0%} of {best}'s free memory",
                    f"free: {label} {value / 2**30:.2f} GiB, {best} {free[best] / 2**30:.2f} GiB; other processes "
                    f"hold {others[label] / 2**30:.2f} GiB on {label}",
                    f"Other processes are using {label}. Stop them, or leave {label} out of device_ids.",
                    value / free[best], "ratio"))
    return findings
