"""Device ids as torch takes them, plus CPU workers, resolved into one validated form.

A leaf below recording and parallel/: a run notes the devices a call uses, and every piece of
parallel/ takes device ids; neither needs the other to know what a device id is."""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["DeviceLike", "CudaIds", "DeviceSet", "MAX_DEVICE_INDEX", "MAX_CPU_WORKERS", "cpu_devices", "rank_devices",
           "resolve_devices", "is_cpu_worker_list"]

DeviceLike = Union[int, str, torch.device]
# The ids torch's own CUDA pieces (scatter, gather, replicate, parallel_apply) are typed to take. Each id goes
# through torch's _get_device_index, which takes "cuda:N" strings too: dpprof hands them DeviceLike ids as given.
CudaIds = Sequence[Union[int, torch.device]]
# torch keeps a device's index in one signed byte (c10::DeviceIndex): torch.device("cpu", 128) is cpu:-128 and
# "cpu:255" is a device with no index, so an index past this is refused before torch wraps it.
MAX_DEVICE_INDEX = 127
MAX_CPU_WORKERS = MAX_DEVICE_INDEX + 1
_NAME = re.compile(r"\s*([a-z]+)\s*:\s*(\d+)\s*")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _out_of_range(what: str, kind: str, index: int) -> ValueError:
    """The error for a device index past what exists: which device, and what there is."""
    if kind == "cuda":
        count = _cuda_count()
        there = f"cuda:0 to cuda:{count - 1}" if count > 1 else "cuda:0" if count else "none"
        return ValueError(f"{what}: cuda:{index} does not exist: this machine has {count} CUDA device(s) ({there})")
    return ValueError(f"{what}: cpu:{index} is out of range: CPU workers are cpu:0 to cpu:{MAX_DEVICE_INDEX} "
                      f"(torch numbers a device 0 to {MAX_DEVICE_INDEX})")


def cpu_devices(n: int) -> list[torch.device]:
    """Return ``n`` CPU workers, ``[cpu:0, ..., cpu:n-1]``, usable wherever torch takes device_ids.

    Example:
        >>> net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(4))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"cpu_devices(n) needs a positive number of workers, got {n!r}")
    if n > MAX_CPU_WORKERS:
        raise ValueError(f"cpu_devices({n}): at most {MAX_CPU_WORKERS} CPU workers, cpu:0 to cpu:{MAX_DEVICE_INDEX} "
                         f"(torch numbers a device 0 to {MAX_DEVICE_INDEX})")
    return [torch.device("cpu", i) for i in range(n)]


def _parse(device: DeviceLike, what: str) -> torch.device:
    """One device id as a torch.device with an index; ints mean CUDA, as in torch."""
    if isinstance(device, bool):
        raise TypeError(f"{what}: {device!r} is not a device")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what}: device index {device} is negative")
        if device > MAX_DEVICE_INDEX:
            raise _out_of_range(what, "cuda", device)
        return torch.device("cuda", device)
    if isinstance(device, str):
        named = _NAME.fullmatch(device)
        if named and int(named.group(2)) > MAX_DEVICE_INDEX and named.group(1) in ("cpu", "cuda"):
            raise _out_of_range(what, named.group(1), int(named.group(2)))
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"{what}: {device!r} is not a device name ({err})") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"{what}: {device!r} is not a device (int, 'cuda:N', 'cpu:N' or torch.device)")
    if device.type == "cpu" and device.index is None:
        raise ValueError(
            f"{what}: 'cpu' names no worker; CPU workers are 'cpu:N' (see dpprof.cpu_devices)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: device type {device.type!r} is not supported (cuda or cpu workers)")
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def _is_minus_one(device: object) -> bool:
    """Whether ``device`` is the int -1 (not True, nor -1.0): torch's output_device for the host."""
    return isinstance(device, int) and not isinstance(device, bool) and device == -1


def is_cpu_worker_list(devices: Sequence[DeviceLike | None] | None) -> bool:
    """Whether ``devices`` names CPU workers (the first entry decides; resolve_devices checks the rest)."""
    if not devices:
        return False
    first = devices[0]
    if isinstance(first, str):
        return first.startswith("cpu")
    return isinstance(first, torch.device) and first.type == "cpu"


@dataclass(frozen=True)
class DeviceSet:
    """Validated device ids of one kind: ``type`` is "cuda" or "cpu", ``indices`` are ints."""

    type: str
    indices: tuple[int, ...]
    output_index: int

    def label(self, index: int) -> str:
        return f"{self.type}:{index}"

    @property
    def labels(self) -> list[str]:
        return [self.label(i) for i in self.indices]


@functools.lru_cache(maxsize=1024)
def rank_devices(rank: int) -> DeviceSet:
    """A DDP or FSDP rank as a device set (label ``rank:N``): one object per rank, made once."""
    return DeviceSet("rank", (rank,), rank)


def resolve_devices(device_ids: Sequence[DeviceLike], output_device: DeviceLike | None = None) -> DeviceSet:
    """Check device_ids and output_device and return them as one DeviceSet.

    output_device -1 is torch's "gather onto the host (CPU)", for CUDA devices and CPU workers alike: its
    ``output_index`` is -1.

    Raises a ValueError naming the offending entry for: an empty list, a duplicate,
    CPU workers mixed with CUDA devices, or a CUDA device this machine does not have.
    """
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"device_ids must be a list of devices, got {device_ids!r}")
    if len(device_ids) == 0:
        raise ValueError("device_ids is empty: pass None to use every GPU, or a list of devices")
    parsed = [_parse(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
    kinds = {d.type for d in parsed}
    if len(kinds) > 1:
        raise ValueError(
            f"device_ids mixes CPU workers and CUDA devices ({[str(d) for d in parsed]}); use one kind"
        )
    kind = parsed[0].type
    seen: dict[int, int] = {}
    for i, d in enumerate(parsed):
        if d.index in seen:
            raise ValueError(f"device_ids lists {d} twice (positions {seen[d.index]} and {i})")
        seen[d.index] = i
    if kind == "cuda":
        count = _cuda_count()
        for i, d in enumerate(parsed):
            if d.index >= count:
                raise _out_of_range(f"device_ids[{i}]", "cuda", d.index)
    indices = tuple(d.index for d in parsed)
    if output_device is None:
        out = indices[0]
    else:
        if (kind == "cuda" and output_device in (-1, "cpu")) or (kind == "cpu" and _is_minus_one(output_device)):
            out = -1  # torch's spelling of "gather onto the host": on CPU workers, the host's memory, no worker's
        else:
            od = _parse(output_device, "output_device")
            if od.type != kind:
                raise ValueError(f"output_device {od} is not of the same kind as device_ids ({kind})")
            if kind == "cuda" and od.index >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
                raise ValueError(f"output_device {od} does not exist on this machine")
            if kind == "cpu" and od.index not in indices:
                raise ValueError(f"output_device {od} is not one of the CPU workers in device_ids")
            out = od.index
    return DeviceSet(kind, indices, out)
