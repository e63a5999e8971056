"""parallel_apply with torch's meaning: one thread per replica, on CUDA devices or CPU workers.

CUDA goes to torch.nn.parallel.parallel_apply. CPU workers run the same worker loop:
grad mode and autocast state carried into each thread, a replica's exception re-raised
in the caller with torch's "Caught X in replica i on device d." text.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch._utils import ExceptionWrapper
from torch.nn.parallel.parallel_apply import get_a_var
from torch.nn.parallel.parallel_apply import parallel_apply as _torch_parallel_apply

from dpprof.parallel.devices import DeviceLike, is_cpu_worker_list

__all__ = ["parallel_apply", "get_a_var"]


def _check_lengths(modules: Sequence[Any], inputs: Sequence[Any], kwargs_tup: Sequence[Any] | None,
                   devices: Sequence[Any] | None) -> None:
    if len(modules) != len(inputs):
        raise AssertionError(
            f"The number of modules {len(modules)} is not equal to the number of inputs {len(inputs)}"
        )
    if kwargs_tup is not None and len(modules) != len(kwargs_tup):
        raise AssertionError(
            f"The number of modules {len(modules)} is not equal to the number of kwargs_tup {len(kwargs_tup)}"
        )
    if devices is not None and len(modules) != len(devices):
        raise AssertionError(
            f"The number of modules {len(modules)} is not equal to the number of devices {len(devices)}"
        )


def _cpu_label(device: DeviceLike) -> str:
    return str(torch.device(device)) if not isinstance(device, int) else f"cpu:{device}"


def _cpu_parallel_apply(modules: Sequence[Callable[..., Any]], inputs: Sequence[Any],
                        kwargs_tup: Sequence[dict[str, Any]], devices: Sequence[DeviceLike]) -> list[Any]:
    lock = threading.Lock()
    results: dict[int, Any] = {}
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")

    def _worker(i: int, module: Callable[..., Any], input: Any, kwargs: dict[str, Any], device: DeviceLike) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                output = module(*input, **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i} on device {_cpu_label(device)}")

    if len(modules) > 1:
        threads = [
            threading.Thread(target=_worker, args=(i, m, inp, kw, dev), name=f"dpprof-{_cpu_label(dev)}")
            for i, (m, inp, kw, dev) in enumerate(zip(modules, inputs, kwargs_tup, devices, strict=True))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        _worker(0, modules[0], inputs[0], kwargs_tup[0], devices[0])

    outputs = []
    for i in range(len(inputs)):
        output = results[i]
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


def parallel_apply(modules: Sequence[Callable[..., Any]], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict[str, Any]] | None = None,
                   devices: Sequence[DeviceLike | None] | None = None) -> list[Any]:
    """Apply ``modules[i]`` to ``inputs[i]`` (and ``kwargs_tup[i]``) on ``devices[i]``, all in parallel.

    With ``devices`` None, the device is taken from the inputs, as torch does: CPU
    tensors run on CPU workers 0..n-1.
    """
    _check_lengths(modules, inputs, kwargs_tup, devices)
    if kwargs_tup is None:
        kwargs_tup = ({},) * len(modules)
    if devices is None:
        first = get_a_var(inputs[0]) if inputs else None
        if first is not None and first.device.type == "cpu":
            devices = [torch.device("cpu", i) for i in range(len(modules))]
    if devices is not None and is_cpu_worker_list(devices):
        return _cpu_parallel_apply(modules, inputs, kwargs_tup, devices)
    return _torch_parallel_apply(modules, inputs, kwargs_tup, devices)
