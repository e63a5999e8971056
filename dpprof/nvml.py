"""What NVML says about the GPUs, with missing data as a value.

nvidia-ml-py (module ``pynvml``) is imported lazily and guarded: no library, no GPU, a metric
NOT_SUPPORTED or a GPU lost mid-run gives None for the affected values and one recorded reason,
never an exception in the training loop.
"""
from __future__ import annotations

import importlib
import os
import threading
import time
from types import ModuleType
from typing import Any, Callable

from dpprof.records import SLOWDOWN_REASONS, GpuSampleRecord  # noqa: F401 (SLOWDOWN_REASONS: also read from here)

__all__ = ["Nvml", "NvmlUnavailable", "GpuSampler", "DEFAULT_SAMPLE_HZ", "THROTTLE_REASONS"]

DEFAULT_SAMPLE_HZ = 10.0  # NVML's utilisation window is 1/6 s to 1 s: sampling faster adds nothing
MAX_SAMPLE_HZ = 50.0

# Clock-throttle reason bits (nvmlClocksThrottleReason*), by the name dpprof reports (those that slow the GPU
# down: dpprof.records.SLOWDOWN_REASONS).
THROTTLE_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message is the reason, in one line."""


def _load() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None


def throttle_names(mask: int) -> list[str]:
    return [name for name, bit in THROTTLE_REASONS.items() if mask & bit]


class Nvml:
    """An initialised NVML session: ``with Nvml() as nv: nv.sample(handle)``.

    Every getter returns None when NVML has no value, and remembers why in ``reasons``
    (one entry per metric and cause).
    """

    def __init__(self) -> None:
        self.lib = _load()
        try:
            self.lib.nvmlInit()
        except self.lib.NVMLError as err:
            raise NvmlUnavailable(f"NVML could not start: {err}") from None
        self.reasons: dict[str, str] = {}
        self.on_reason: Callable[[str], None] | None = None  # told each new reason once
        self.lost: set[str] = set()
        self._closed = False

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError:
                pass

    # handles
    def count(self) -> int:
        return self.lib.nvmlDeviceGetCount()

    def handle_by_index(self, index: int) -> Any:
        return self.lib.nvmlDeviceGetHandleByIndex(index)

    def handle_by_bus_id(self, bus_id: str) -> Any:
        return self.lib.nvmlDeviceGetHandleByPciBusId(bus_id)

    def bus_id(self, handle: Any) -> str:
        bus = self.lib.nvmlDeviceGetPciInfo(handle).busId
        return (bus.decode() if isinstance(bus, bytes) else bus).upper()

    def _reason(self, key: str, message: str) -> None:
        if key not in self.reasons:
            self.reasons[key] = message
            if self.on_reason is not None:
                self.on_reason(message)

    # values
    def get(self, label: str, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None with the reason remembered (NOT_SUPPORTED, GPU lost, any NVML error)."""
        if label in self.lost:
            return None
        try:
            return fn(*args)
        except self.lib.NVMLError as err:
            code = getattr(err, "value", None)
            if code == self.lib.NVML_ERROR_GPU_IS_LOST:
                self.lost.add(label)
                self._reason(f"{label}:lost", f"{label}: GPU is lost (NVML); its values are null from here on")
            elif code == self.lib.NVML_ERROR_NOT_SUPPORTED:
                self._reason(f"{label}:{metric}", f"{label}: {metric} not supported by this GPU or driver")
            else:
                self._reason(f"{label}:{metric}", f"{label}: {metric} unavailable: {err}")
            return None

    def sample(self, handle: Any, label: str, t_ms: float, own_pid: int | None = None) -> GpuSampleRecord:
        lib, get = self.lib, self.get
        util = get(label, "utilisation", lib.nvmlDeviceGetUtilizationRates, handle)
        mem = get(label, "memory", lib.nvmlDeviceGetMemoryInfo, handle)
        power = get(label, "power draw", lib.nvmlDeviceGetPowerUsage, handle)
        limit = get(label, "power limit", lib.nvmlDeviceGetEnforcedPowerLimit, handle)
        temp = get(label, "temperature", lib.nvmlDeviceGetTemperature, handle, lib.NVML_TEMPERATURE_GPU)
        sm = get(label, "SM clock", lib.nvmlDeviceGetClockInfo, handle, lib.NVML_CLOCK_SM)
        tx = get(label, "PCIe throughput", lib.nvmlDeviceGetPcieThroughput, handle, lib.NVML_PCIE_UTIL_TX_BYTES)
        rx = get(label, "PCIe throughput", lib.nvmlDeviceGetPcieThroughput, handle, lib.NVML_PCIE_UTIL_RX_BYTES)
        mask = get(label, "throttle reasons", lib.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        procs = get(label, "processes", lib.nvmlDeviceGetComputeRunningProcesses, handle)
        own_pid = os.getpid() if own_pid is None else own_pid
        others = None
        if procs is not None:
            others = sum((p.usedGpuMemory or 0) for p in procs if p.pid != own_pid)
        return GpuSampleRecord(
            t_ms=t_ms, device=label,
            gpu_util_pct=None if util is None else float(util.gpu),
            memory_util_pct=None if util is None else float(util.memory),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            temperature_c=None if temp is None else float(temp),
            sm_clock_mhz=None if sm is None else float(sm),
            pcie_tx_bytes_per_s=None if tx is None else tx * 1024.0,  # NVML reports KB/s
            pcie_rx_bytes_per_s=None if rx is None else rx * 1024.0,
            throttle_reasons=None if mask is None else ",".join(throttle_names(mask)),
            other_process_memory_bytes=others,
        )

    def pcie_link(self, handle: Any, label: str) -> dict[str, int | None]:
        lib, get = self.lib, self.get
        return {
            "gen": get(label, "PCIe link", lib.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "max_gen": get(label, "PCIe link", lib.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "width": get(label, "PCIe link", lib.nvmlDeviceGetCurrPcieLinkWidth, handle),
            "max_width": get(label, "PCIe link", lib.nvmlDeviceGetMaxPcieLinkWidth, handle),
        }


class GpuSampler:
    """A background thread that samples GPUs through NVML at ``hz`` and hands each sample to ``emit``.

    ``handles`` maps torch labels ("cuda:0") to NVML handles. Stop with ``close()`` or a ``with`` block.
    """

    def __init__(self, nvml: Nvml, handles: dict[str, Any], emit: Callable[[GpuSampleRecord], None],
                 clock_ms: Callable[[], float], hz: float = DEFAULT_SAMPLE_HZ) -> None:
        if not 0 < hz <= MAX_SAMPLE_HZ:
            raise ValueError(f"sampling rate must be in (0, {MAX_SAMPLE_HZ:g}] Hz, got {hz}")
        self.nvml, self.handles, self.emit, self.clock_ms = nvml, handles, emit, clock_ms
        self.period_s = 1.0 / hz
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpprof-nvml", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        pid = os.getpid()
        next_t = time.monotonic()
        while not self._stop.is_set():
            for label, handle in self.handles.items():
                self.emit(self.nvml.sample(handle, label, self.clock_ms(), pid))
            self.samples += 1
            next_t += self.period_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
