"""replicate with torch's meaning on CUDA devices and on CPU workers.

On CPU workers replicate does what torch's Broadcast does across GPUs: replica 0, on
device_ids[0], shares the module's parameters and buffers (its parameters are differentiable
views), and every other replica holds its own copies, paid for in the replicate phase's time
and memory as a GPU pays for them. Backward sums the replicas' gradients into the module's
.grad (sparse ones too). Without grad, a replica whose copies are large enough for torch to make
with several threads makes them on its own worker (see _detached_copies).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import TypeVar, cast

import torch
from torch.autograd import Function
from torch.jit import ScriptModule as _ScriptModule
from torch.nn import Module
from torch.nn.modules import module as _module_hooks
from torch.nn.parallel.replicate import _replicatable_module
from torch.nn.parallel.replicate import replicate as _torch_replicate

from dpprof.device_ids import CudaIds, DeviceLike, is_cpu_worker_list
from dpprof.parallel.workers import on_worker_thread, run_on_workers, worker_index

__all__ = ["replicate"]

T = TypeVar("T", bound=Module)


class CpuBroadcast(Function):
    """Hand worker 0 a view of every input and each other worker a copy; backward sums their gradients."""

    @staticmethod
    def forward(ctx, num_replicas: int, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.num_inputs = len(inputs)
        outputs = [t.view_as(t) if j == 0 else t.clone() for j in range(num_replicas) for t in inputs]
        frozen = [
            outputs[j * len(inputs) + i]
            for i, needs in enumerate(ctx.needs_input_grad[1:])
            if not needs
            for j in range(num_replicas)
        ]
        ctx.mark_non_differentiable(*frozen)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        n = ctx.num_inputs
        sums: list[torch.Tensor | None] = []
        for i in range(n):
            total = None
            for g in grads[i::n]:
                if g is not None:
                    total = g if total is None else total + g
            sums.append(total)
        return (None, *sums)


# torch copies a tensor of at least this many elements with its intra-op threads (at::internal::GRAIN_SIZE)
PARALLEL_COPY_NUMEL = 32768


def _cpu_copies(tensors: list[torch.Tensor], num_replicas: int) -> list[list[torch.Tensor]]:
    """Per-replica lists of parameter-like tensors: replica 0's views, the others' differentiable copies."""
    if not tensors:
        return [[] for _ in range(num_replicas)]
    flat = CpuBroadcast.apply(num_replicas, *tensors)
    n = len(tensors)
    return [list(flat[j * n:(j + 1) * n]) for j in range(num_replicas)]


def _cpu_buffer_copies(buffers: list[torch.Tensor], num_replicas: int) -> list[list[torch.Tensor]]:
    """Replica 0 shares each buffer (in-place updates persist); the others get copies, as on GPUs."""
    return [list(buffers) if j == 0 else [b.detach().clone() for b in buffers] for j in range(num_replicas)]


def _detached_copies(params: list[torch.Tensor], buffers: list[torch.Tensor],
                     workers: list[int]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """A no-grad replicate's per-replica parameters and buffers: replica 0 the module's own (parameters
    detached), every other replica copies.

    Where a copy is large enough for torch to make it with several threads, each replica's copies are
    made on its own worker, with that worker's share of the threads, as a GPU receives its broadcast:
    a parallel op on the calling thread leaves the calling thread's OpenMP helpers spinning for
    milliseconds (~8 ms measured), on the cores the workers need for the forward that comes next
    (bench/workers.py: the CIFAR-10 Net's forward on 2 workers took 17-20 ms after copies made on
    the calling thread, 9.8-10.7 ms after copies made on the workers). With grad on, the copies are
    autograd's broadcast on the calling thread, as are backward and the optimizer's step; the helpers
    they leave spinning are released before the forward's hand-off (dpprof.parallel.workers).
    """
    first = ([t.detach() for t in params], list(buffers))

    def copies() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [t.detach().clone() for t in params], [b.detach().clone() for b in buffers]

    n = len(workers)
    if (n > 1 and torch.get_num_threads() > 1 and not on_worker_thread()
            and any(t.numel() >= PARALLEL_COPY_NUMEL for t in chain(params, buffers))):
        # worker 0 too, with nothing to copy: a call over every worker gives each the share the
        # forward gives it, where a call without worker 0 would change every worker's thread count
        per_replica = run_on_workers(workers, [lambda: first] + [copies] * (n - 1), "replicate")
    else:
        per_replica = [first] + [copies() for _ in range(n - 1)]
    return [p for p, _ in per_replica], [b for _, b in per_replica]


def _module_copy_by_torch(module: Module) -> Module:
    replica = module._replicate_for_data_parallel()  # a lazy module refuses here, as in torch
    replica._former_parameters = OrderedDict()
    return replica


def _module_copy(module: Module) -> Module:
    """What Module._replicate_for_data_parallel returns, with _former_parameters, built in one
    step rather than through Module.__setattr__ five times."""
    replica = module.__new__(type(module))
    state = module.__dict__.copy()
    state["_parameters"] = {}
    state["_buffers"] = state["_buffers"].copy()
    state["_modules"] = state["_modules"].copy()
    state["_is_replica"] = True
    state["_former_parameters"] = OrderedDict()
    object.__setattr__(replica, "__dict__", state)
    return replica


def _plain_setattr(module: Module) -> bool:
    """Whether assigning to ``module`` is Module.__setattr__ with no registration hooks: then the
    replicas' attributes can be put in place directly, with the same result, at a fraction of the cost."""
    cls = type(module)
    return (cls.__setattr__ is Module.__setattr__ and cls.register_buffer is Module.register_buffer
            and not _module_hooks._global_module_registration_hooks
            and not _module_hooks._global_buffer_registration_hooks)


def _cpu_replicate(network: T, workers: list[int], detach: bool) -> list[T]:
    num_replicas = len(workers)
    # Copy the modules first: a lazy module refuses here with torch's RuntimeError, before
    # any uninitialized parameter is touched.
    modules = list(network.modules())
    # torch's check, in full only where there is a ScriptModule to check
    if any(isinstance(m, _ScriptModule) for m in modules) and not _replicatable_module(network):
        raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")
    module_indices = {m: i for i, m in enumerate(modules)}
    module_copies: list[list[Module]] = [[] for _ in range(num_replicas)]
    for module in modules:
        plain = type(module)._replicate_for_data_parallel is Module._replicate_for_data_parallel
        for j in range(num_replicas):
            module_copies[j].append(_module_copy(module) if plain else _module_copy_by_torch(module))

    # parameters and buffers in network.parameters() / buffers() order (each once), keyed by id:
    # a tensor's own __hash__ is a Python call
    params: dict[int, int] = {}
    param_list: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    seen_buffers: set[int] = set()
    for module in modules:
        for p in module._parameters.values():
            if p is not None and id(p) not in params:
                params[id(p)] = len(param_list)
                param_list.append(p)
        for b in module._buffers.values():
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                buffers.append(b)
    for t in chain(param_list, buffers):
        if not t.is_cpu:
            raise RuntimeError(f"cannot replicate onto CPU workers: a parameter or buffer is on {t.device}")
    buffers_rg = [b for b in buffers if b.requires_grad and not detach]
    buffers_not_rg = [b for b in buffers if not (b.requires_grad and not detach)]
    rg_indices = {id(b): i for i, b in enumerate(buffers_rg)}
    not_rg_indices = {id(b): i for i, b in enumerate(buffers_not_rg)}
    if detach:
        param_copies, not_rg_copies = _detached_copies(param_list, buffers_not_rg, workers)
    else:
        param_copies = _cpu_copies(param_list, num_replicas)
        not_rg_copies = _cpu_buffer_copies(buffers_not_rg, num_replicas)
    rg_copies = _cpu_copies(buffers_rg, num_replicas)

    for i, module in enumerate(modules):
        direct = _plain_setattr(module)
        for key, child in module._modules.items():
            for j in range(num_replicas):
                if child is None:
                    module_copies[j][i]._modules[key] = None
                elif direct:
                    module_copies[j][i]._modules[key] = module_copies[j][module_indices[child]]
                else:
                    setattr(module_copies[j][i], key, module_copies[j][module_indices[child]])
        for key, param in module._parameters.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if param is None:
                    replica._parameters[key] = None
                else:
                    # parameters in replicas are not leaves: plain attributes, as in torch
                    copy = param_copies[j][params[id(param)]]
                    if direct:
                        replica.__dict__[key] = copy
                    else:
                        setattr(replica, key, copy)
                    replica.__dict__["_former_parameters"][key] = copy
        for key, buf in module._buffers.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if buf is None:
                    replica._buffers[key] = None
                    continue
                if buf.requires_grad and not detach:
                    copy = rg_copies[j][rg_indices[id(buf)]]
                else:
                    copy = not_rg_copies[j][not_rg_indices[id(buf)]]
                if direct:
                    replica._buffers[key] = copy
                else:
                    setattr(replica, key, copy)
    return [module_copies[j][0] for j in range(num_replicas)]  # type: ignore[misc]


def replicate(network: T, devices: Sequence[DeviceLike], detach: bool = False) -> list[T]:
    """One replica of ``network`` per device; torch's own replicate on CUDA."""
    if not is_cpu_worker_list(devices):
        return _torch_replicate(network, cast(CudaIds, devices), detach)
    if not devices:
        if not _replicatable_module(network):
            raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")
        return []
    return _cpu_replicate(network, [worker_index(d) for d in devices], detach)
