"""parallel_apply with torch's meaning: one thread per replica, on CUDA devices or CPU workers.

CUDA goes to torch.nn.parallel.parallel_apply. CPU workers run the same loop on their own
long-lived threads (dpprof.parallel.workers): grad mode and autocast state carried into each,
a replica's exception re-raised in the caller with torch's "Caught X in replica i on device d."
text.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Callable, cast

import torch
from torch._utils import ExceptionWrapper
from torch.nn import Module
from torch.nn.parallel.parallel_apply import get_a_var
from torch.nn.parallel.parallel_apply import parallel_apply as _torch_parallel_apply

from dpprof.device_ids import DeviceLike, is_cpu_worker_list
from dpprof.parallel.probe import MeasuredReplica
from dpprof.parallel.workers import on_worker_thread, run_on_workers, worker_index

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
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")

    def _task(i: int, module: Callable[..., Any], input: Any, kwargs: dict[str, Any],
              device: DeviceLike) -> Callable[[], Any]:
        def run() -> Any:
            torch.set_grad_enabled(grad_enabled)
            args = input if isinstance(input, (list, tuple)) else (input,)
            # autocast off here and in the caller: entering autocast(enabled=False) would change nothing
            autocast = (torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_enabled)
                        if autocast_enabled or torch.is_autocast_enabled("cpu") else nullcontext())
            try:
                with autocast:
                    return module(*args, **kwargs)
            except Exception:
                return ExceptionWrapper(where=f"in replica {i} on device {_cpu_label(device)}")
        return run

    tasks = [_task(i, m, inp, kw, dev)
             for i, (m, inp, kw, dev) in enumerate(zip(modules, inputs, kwargs_tup, devices, strict=True))]
    if len(tasks) == 1:
        outputs = [tasks[0]()]
    elif on_worker_thread():
        # a DataParallel inside a replica: the workers may be busy with the outer call, so this
        # call gets threads of its own, as torch's parallel_apply always does
        outputs = _on_new_threads(tasks)
    else:
        # calls alike in length are calls of one class of module (a model's forward, a criterion's)
        first = modules[0]
        kind: type = type(first.module) if isinstance(first, MeasuredReplica) else type(first)
        outputs = run_on_workers([worker_index(d) for d in devices], tasks, kind)
    for output in outputs:
        if isinstance(output, ExceptionWrapper):
            output.reraise()
    return outputs


def _on_new_threads(tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(tasks)

    def run(i: int) -> None:
        results[i] = tasks[i]()

    threads = [threading.Thread(target=run, args=(i,), name=f"dpprof-replica-{i}") for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _on_accelerator(obj: Any) -> bool:
    var = get_a_var(obj) if obj is not None else None
    return var is not None and var.device.type != "cpu"


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
    if devices is None and not any(_on_accelerator(x) for x in inputs):
        # torch takes the device from the inputs; with none on a GPU (CPU tensors, no tensor,
        # None) the replicas run on CPU workers 0..n-1
        devices = [torch.device("cpu", i) for i in range(len(modules))]
    if devices is not None and is_cpu_worker_list(devices):  # CPU workers, every one named (resolve_devices)
        return _cpu_parallel_apply(modules, inputs, kwargs_tup, cast(Sequence[DeviceLike], devices))
    # torch's is typed for modules and int or device ids; it calls each module and passes each id through
    # _get_device_index, so MeasuredReplica callables and "cuda:N" strings go through as they are
    return _torch_parallel_apply(cast(Sequence[Module], modules), inputs, kwargs_tup,
                                 cast("Sequence[int | torch.device | None] | None", devices))
