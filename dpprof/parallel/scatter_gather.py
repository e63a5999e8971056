"""scatter, scatter_kwargs and gather with torch's meaning, on CUDA devices and on CPU workers.

CUDA goes to torch.nn.parallel's own functions. On CPU workers each device gets a contiguous copy of
its chunk, as torch's Scatter copies each chunk to its GPU: a replica that changes its input in place
changes neither the caller's batch nor another replica's (and a chunk is no view for autograd to refuse).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.nn.parallel import scatter_gather as _torch_sg

from dpprof.device_ids import CudaIds, DeviceLike, is_cpu_worker_list
from dpprof.parallel.callers import caller_level

__all__ = ["scatter", "scatter_kwargs", "scatter_sized", "gather", "check_scatter_dim"]

_CPU_AS_MINUS_ONE_WARNING = (  # torch.nn.parallel.comm.gather's text
    "Using -1 to represent CPU tensor is deprecated. Please use a "
    'device object or string instead, e.g., "cpu".'
)
_SCALAR_GATHER_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def check_scatter_dim(obj: Any, dim: int) -> None:
    """Raise what torch's scatter raises, naming the shape: IndexError where ``dim`` is out of range for a tensor in
    ``obj``, RuntimeError for a 0-dim tensor (torch.chunk's "expects at least a 1-dimensional tensor")."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise RuntimeError("chunk expects at least a 1-dimensional tensor: an input to scatter is a 0-dim "
                               "tensor (a scalar), which has no batch dimension to split")
        if not -obj.dim() <= dim < obj.dim():
            raise IndexError(
                f"cannot scatter along dim={dim}: an input has shape {tuple(obj.shape)} "
                f"({obj.dim()} dimension(s)); dim must be in [{-obj.dim()}, {obj.dim() - 1}]"
            )
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            check_scatter_dim(item, dim)
    elif isinstance(obj, dict):
        for item in obj.values():
            check_scatter_dim(item, dim)


def _scatter_map(inputs: Any, split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], n: int) -> Any:
    """torch's scatter recursion: tensors split by ``split``, containers rebuilt per device with their
    types, anything else passed to all ``n`` devices by reference."""

    def scatter_map(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return split(obj)
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj))]
        if isinstance(obj, tuple) and len(obj) > 0:
            return list(zip(*map(scatter_map, obj)))
        if isinstance(obj, list) and len(obj) > 0:
            return [list(i) for i in zip(*map(scatter_map, obj))]
        if isinstance(obj, dict) and len(obj) > 0:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()))]
        return [obj for _ in range(n)]

    try:
        return scatter_map(inputs)
    finally:
        scatter_map = None  # type: ignore[assignment]  # break the closure's reference cycle, as torch does


def _device_copy(chunk: torch.Tensor) -> torch.Tensor:
    """A chunk as a device receives it: a contiguous copy of its own, differentiable back to the batch."""
    return chunk.clone(memory_format=torch.contiguous_format)


def _cpu_scatter(inputs: Any, target: Sequence[DeviceLike], dim: int) -> Any:
    n = len(target)
    return _scatter_map(inputs, lambda t: tuple(_device_copy(chunk) for chunk in t.chunk(n, dim)), n)


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> Any:
    """Slice tensors into torch.chunk pieces, one per device; other objects are shared by reference."""
    check_scatter_dim(inputs, dim)
    if is_cpu_worker_list(target_gpus):
        return _cpu_scatter(inputs, target_gpus, dim)
    return _torch_sg.scatter(inputs, cast(CudaIds, target_gpus), dim)


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword inputs; pad the shorter side with () or {} as torch does."""
    scattered_inputs = scatter(inputs, target_gpus, dim) if inputs else []
    scattered_kwargs = scatter(kwargs, target_gpus, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def scatter_sized(inputs: Any, target_devices: Sequence[DeviceLike], chunk_sizes: Sequence[int],
                  dim: int = 0) -> list[Any]:
    """Scatter like ``scatter`` but into the given chunk sizes (to split targets as the inputs were split).

    Raises:
        ValueError: a tensor's size along ``dim`` is not the sum of ``chunk_sizes``.
    """
    check_scatter_dim(inputs, dim)
    cpu = is_cpu_worker_list(target_devices)
    total = sum(chunk_sizes)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if t.size(dim) != total:
            raise ValueError(
                f"the outputs were split {'+'.join(map(str, chunk_sizes))} = {total} along dim {dim}, "
                f"but a target of shape {tuple(t.shape)} holds {t.size(dim)}")
        if cpu:
            return tuple(_device_copy(c) for c in t.split(list(chunk_sizes), dim))
        from torch.nn.parallel._functions import Scatter
        return Scatter.apply(list(target_devices), list(chunk_sizes), dim, t)

    return _scatter_map(inputs, split, len(target_devices))


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(obj, dict):
        for item in obj.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _cpu_gather_tensors(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    if dim == 0 and all(t.dim() == 0 for t in tensors):
        warnings.warn(_SCALAR_GATHER_WARNING, stacklevel=caller_level())  # the script's line, at any depth
        tensors = [t.view(1) for t in tensors]
    return torch.cat(list(tensors), dim)


def _cpu_gather(outputs: Any, dim: int) -> Any:
    def gather_map(outputs: Any) -> Any:
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            return _cpu_gather_tensors(outputs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outputs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outputs, strict=True)))
        return type(out)(map(gather_map, zip(*outputs, strict=True)))

    try:
        return gather_map(outputs)
    finally:
        gather_map = None  # type: ignore[assignment]


def gather(outputs: Any, target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-device outputs along ``dim`` onto ``target_device``, keeping container types."""
    first = _first_tensor(outputs)
    if first is not None and first.device.type == "cpu":
        if isinstance(target_device, int) and target_device == -1:
            warnings.warn(_CPU_AS_MINUS_ONE_WARNING, FutureWarning, stacklevel=2)
        return _cpu_gather(outputs, dim)
    return _torch_sg.gather(outputs, cast("int | torch.device", target_device), dim)
