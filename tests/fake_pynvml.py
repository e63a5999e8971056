"""A small stand-in for nvidia-ml-py's ``pynvml``, installed by the tests as sys.modules["pynvml"].

It answers the calls dpprof makes with realistic values for a few GPUs, and can be told to
fail the ways real NVML does: library missing, a metric NOT_SUPPORTED, a GPU lost mid-run.
"""
from __future__ import annotations

from types import SimpleNamespace

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 12: "NVML Shared Library Not Found", 15: "GPU is lost"}.get(self.value, "Unknown")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)


GIB = 2**30


def gpu(bus_id: str, name: str = "NVIDIA A100-SXM4-40GB", total: int = 40 * GIB, used: int = 2 * GIB,
        util: int = 90, power_mw: int = 250_000, limit_mw: int = 400_000, temp: int = 60, sm_mhz: int = 1410,
        throttle: int = 0, link: tuple[int, int, int, int] = (4, 4, 16, 16), others_bytes: int = 0) -> dict:
    """One fake GPU; link is (gen, max gen, width, max width)."""
    return dict(bus_id=bus_id, name=name, total=total, used=used, util=util, power=power_mw, limit=limit_mw,
                temp=temp, sm=sm_mhz, throttle=throttle, link=link, others=others_bytes)


# state the tests set
GPUS: list[dict] = []
LIBRARY_MISSING = False
NOT_SUPPORTED: set[str] = set()  # names of functions that raise NOT_SUPPORTED
LOST_AFTER: dict[int, int] = {}  # GPU index -> calls after which it is lost
calls: dict[int, int] = {}
initialised = 0


def reset(gpus: list[dict]) -> None:
    global LIBRARY_MISSING, initialised
    GPUS[:] = gpus
    LIBRARY_MISSING = False
    NOT_SUPPORTED.clear()
    LOST_AFTER.clear()
    calls.clear()
    initialised = 0


def nvmlInit() -> None:
    global initialised
    if LIBRARY_MISSING:
        raise NVMLError_LibraryNotFound()
    initialised += 1


def nvmlShutdown() -> None:
    global initialised
    initialised -= 1


def nvmlDeviceGetCount() -> int:
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < len(GPUS):
        raise NVMLError(2)
    return i


def nvmlDeviceGetHandleByPciBusId(bus_id: str) -> int:
    for i, g in enumerate(GPUS):
        if g["bus_id"].upper() == bus_id.upper():
            return i
    raise NVMLError(6)  # NVML_ERROR_NOT_FOUND


def _check(fn: str, h: int) -> dict:
    if fn in NOT_SUPPORTED:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    calls[h] = calls.get(h, 0) + 1
    if h in LOST_AFTER and calls[h] > LOST_AFTER[h]:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return GPUS[h]


def nvmlDeviceGetPciInfo(h: int) -> SimpleNamespace:
    return SimpleNamespace(busId=GPUS[h]["bus_id"].encode())


def nvmlDeviceGetUtilizationRates(h: int) -> SimpleNamespace:
    g = _check("nvmlDeviceGetUtilizationRates", h)
    return SimpleNamespace(gpu=g["util"], memory=g["util"] // 2)


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    g = _check("nvmlDeviceGetMemoryInfo", h)
    used = g["used"] + g["others"]
    return SimpleNamespace(total=g["total"], used=used, free=g["total"] - used)


def nvmlDeviceGetPowerUsage(h: int) -> int:
    return _check("nvmlDeviceGetPowerUsage", h)["power"]


def nvmlDeviceGetEnforcedPowerLimit(h: int) -> int:
    return _check("nvmlDeviceGetEnforcedPowerLimit", h)["limit"]


def nvmlDeviceGetTemperature(h: int, sensor: int) -> int:
    return _check("nvmlDeviceGetTemperature", h)["temp"]


def nvmlDeviceGetClockInfo(h: int, clock: int) -> int:
    return _check("nvmlDeviceGetClockInfo", h)["sm"]


def nvmlDeviceGetPcieThroughput(h: int, counter: int) -> int:
    _check("nvmlDeviceGetPcieThroughput", h)
    return 1_000_000 if counter == NVML_PCIE_UTIL_TX_BYTES else 500_000  # KB/s


def nvmlDeviceGetCurrentClocksThrottleReasons(h: int) -> int:
    return _check("nvmlDeviceGetCurrentClocksThrottleReasons", h)["throttle"]


def nvmlDeviceGetComputeRunningProcesses(h: int) -> list[SimpleNamespace]:
    g = _check("nvmlDeviceGetComputeRunningProcesses", h)
    import os
    procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=g["used"])]
    if g["others"]:
        procs.append(SimpleNamespace(pid=1, usedGpuMemory=g["others"]))
    return procs


def nvmlDeviceGetCurrPcieLinkGeneration(h: int) -> int:
    return _check("nvmlDeviceGetCurrPcieLinkGeneration", h)["link"][0]


def nvmlDeviceGetMaxPcieLinkGeneration(h: int) -> int:
    return _check("nvmlDeviceGetMaxPcieLinkGeneration", h)["link"][1]


def nvmlDeviceGetCurrPcieLinkWidth(h: int) -> int:
    return _check("nvmlDeviceGetCurrPcieLinkWidth", h)["link"][2]


def nvmlDeviceGetMaxPcieLinkWidth(h: int) -> int:
    return _check("nvmlDeviceGetMaxPcieLinkWidth", h)["link"][3]
