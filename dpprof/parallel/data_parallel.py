"""dpprof.DataParallel and dpprof.data_parallel: torch's DataParallel, every phase measured.

On CUDA the work is done by torch's scatter, replicate, parallel_apply and gather; on
CPU workers by dpprof's implementations of the same semantics. Each phase runs inside a
``dpprof.<phase>`` torch.profiler range (dpprof.parallel.ranges), and inside a run
(``dpprof.record``) it is timed.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch.nn import Module

from dpprof.device_ids import DeviceLike, DeviceSet, resolve_devices
from dpprof.parallel.callers import caller_level
from dpprof.parallel.parallel_apply import parallel_apply
from dpprof.parallel.probe import ForwardProbe, MeasuredReplica, end_after_error, watch_backward
from dpprof.parallel.ranges import profiler_on, profiler_range
from dpprof.parallel.replicate import replicate
from dpprof.parallel.scatter_gather import gather, scatter_kwargs
from dpprof.parallel.workers import on_worker_thread
from dpprof.recording import current_run

__all__ = ["DataParallel", "data_parallel", "cpu_output_device", "device_index"]

_HOST = DeviceSet("cpu", (0,), 0)  # where the module runs when there is no device to spread over
HOST_LABEL = _HOST.label(0)  # the label of that device; dpprof.parallel.balanced uses it too


def cpu_output_device(output_index: int) -> torch.device:
    """A CPU-worker DataParallel's ``output_device`` as ``tensor.to`` takes it: ``cpu:N`` for worker N, the host's
    ``cpu`` for -1 (torch's "gather onto the host"). Not an int: torch reads an int as a CUDA device."""
    return torch.device("cpu") if output_index == -1 else torch.device("cpu", output_index)


def device_index(device: int | torch.device) -> int:
    """An output device as the index the pieces below take: ``cpu:N`` is N, the host's ``cpu`` (no index) -1, an
    int itself."""
    if isinstance(device, torch.device):
        return -1 if device.index is None else device.index
    return device


@functools.lru_cache(maxsize=64)
def _cpu_targets(device_ids: tuple[int, ...]) -> tuple[torch.device, ...]:
    return tuple(torch.device("cpu", i) for i in device_ids)


def _first_misplaced(module: Module, device: torch.device) -> torch.device | None:
    """The device of the first parameter, then buffer, of ``module`` that is not on ``device`` (torch's
    check, in its order); on the CPU a walk over the modules' own dicts, which runs every step in
    less than half the time of parameters() and buffers() (8 against 19 us on a 5-module MLP)."""
    if device.type != "cpu":
        for t in chain(module.parameters(), module.buffers()):
            if t.device != device:
                return t.device
        return None
    modules = list(module.modules())
    for attr in ("_parameters", "_buffers"):
        for m in modules:
            for t in getattr(m, attr).values():
                if t is not None and not t.is_cpu:
                    return t.device
    return None


@functools.lru_cache(maxsize=256)
def _device_label(kind: str, index: int) -> str:
    """DeviceSet.label's text, made once per device: labels are asked for several times a step."""
    return DeviceSet(kind, (index,), index).label(index)


_RANGE_NAMES = {phase: f"dpprof.{phase}" for phase in ("scatter", "replicate", "parallel_apply", "gather")}


class _PhaseRange:
    """A phase's torch.profiler range and, inside a run, its timing (on every step's path: one plain
    object, no generator)."""

    __slots__ = ("range", "probe", "name", "label", "t0", "ev0")

    def __init__(self, probe: ForwardProbe | None, name: str, label: str) -> None:
        self.range = profiler_range(_RANGE_NAMES.get(name) or f"dpprof.{name}")
        self.probe, self.name, self.label = probe, name, label

    def __enter__(self) -> None:
        self.range.__enter__()
        probe = self.probe
        if probe is not None:
            self.ev0 = probe.start_event(self.label) if probe.cuda_indices else None
            self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.probe is not None:
                self.probe.finish_phase(self.name, self.label, self.t0, self.ev0)
        finally:
            self.range.__exit__(*exc)


SHARED_GENERATOR_NOTE = (
    "the model's {what} draws random numbers in its replicas on {n} CPU workers, which share the CPU's one generator (each GPU has "
    "its own): the masks depend on the order the worker threads reach it, so a seeded run does not repeat, and "
    "activation checkpointing (torch.utils.checkpoint) can recompute a replica with another mask than its forward "
    "drew: wrong gradients. Train it with that off, or on one worker, on CPU workers")


def _say_shared_generator(module: Module, workers: int) -> None:
    """Warn (and note in the run being recorded) where a module trained on several CPU workers has dropout on: the
    workers' random draws share one generator (docs/recording.md)."""
    if workers < 2:
        return
    drops = [m for m in module.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    if not drops:
        return
    message = SHARED_GENERATOR_NOTE.format(what=f"{type(drops[0]).__name__}(p={drops[0].p:g})", n=workers)
    run = current_run()
    if run is not None:
        run.note("dpprof", message, tell=False)
    warnings.warn(message, UserWarning, stacklevel=caller_level())


class DataParallel(torch.nn.DataParallel):
    """torch.nn.DataParallel that also runs on CPU workers and records every phase of every step.

    Args:
        module: the module to parallelize; its parameters and buffers must be on device_ids[0].
        device_ids: CUDA devices (ints, "cuda:N", torch.device) or CPU workers ("cpu:N",
            torch.device("cpu", N), dpprof.cpu_devices(n)). Default: every GPU; with no GPU the
            module runs directly, as in torch.
        output_device: where outputs are gathered (default: device_ids[0]); -1, as in torch: onto the host (the
            CPU). On CPU workers ``self.output_device`` is a torch.device (``cpu:N``, or ``cpu`` for -1), so
            ``x.to(net.output_device)`` stays on the CPU; ``device_ids`` are indices, as torch keeps them.
        dim: the dimension inputs are chunked and outputs concatenated along.

    Example:
        >>> net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
        >>> with dpprof.record(name="demo") as run:
        ...     net(torch.randn(30, 5)).sum().backward()
    """

    def __init__(self, module: Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0) -> None:
        devices = None
        if device_ids is not None or torch.cuda.is_available():
            all_gpus = list(range(torch.cuda.device_count()))
            devices = resolve_devices(all_gpus if device_ids is None else device_ids, output_device)
        if devices is None or devices.type == "cuda":
            super().__init__(module, device_ids, output_device, dim)
        else:
            Module.__init__(self)
            torch._C._log_api_usage_once("torch.nn.parallel.DataParallel")
            self.module = module
            self.dim = dim
            self.device_ids = list(devices.indices)
            self.output_device = cpu_output_device(devices.output_index)
            self.src_device_obj = torch.device("cpu")  # CPU tensors carry no worker index
        self.__dict__["_devices"] = devices
        self.__dict__["_probe"] = None

    # what a subclass changes (DataParallelCriterion): whether backward is timed from this
    # module's output, how many leading arguments are another module's outputs, and whether
    # a call starts a step
    _watch_backward = True
    _shared_args = 0
    _starts_step = True  # without run.step(), a forward call starts a new step

    @classmethod
    def _functional(cls, module: Module, devices: DeviceSet, dim: int) -> DataParallel:
        """A DataParallel around ``module`` for data_parallel: no balance check, nothing moved."""
        self = cls.__new__(cls)
        Module.__init__(self)
        self.module = module
        self.dim = dim
        self.device_ids = list(devices.indices)
        if devices.type == "cpu":
            self.output_device = cpu_output_device(devices.output_index)
            self.src_device_obj = torch.device("cpu")
        else:
            self.output_device = devices.output_index
            self.src_device_obj = torch.device("cuda", devices.indices[0])
        self.__dict__["_devices"] = devices
        self.__dict__["_probe"] = None
        return self

    # device ids as the pieces below want them (CPU workers' torch.device lists made once per id list)
    def _targets(self, device_ids: Sequence[int]) -> list[Any]:
        devices = self.__dict__["_devices"]
        if devices.type != "cpu":
            return list(device_ids)
        return list(_cpu_targets(tuple(device_ids)))

    def _output_target(self, index: int) -> Any:
        """Where gather (and the balanced criterion's reduce) put outputs gathered onto output device ``index``: its
        device, or for -1 the host (the CPU's torch.device on CPU workers, torch's -1 on GPUs)."""
        if index != -1:
            return self._targets([index])[0]
        devices = self.__dict__["_devices"]
        return cpu_output_device(-1) if devices is not None and devices.type == "cpu" else -1

    def _label(self, index: int) -> str:
        devices = self.__dict__["_devices"]
        if devices is None:
            return HOST_LABEL
        return "cpu" if index == -1 else _device_label(devices.type, index)

    def _phase(self, name: str, index: int) -> _PhaseRange:
        """``with self._phase("scatter", device):`` a dpprof.<name> range, timed when recording."""
        return _PhaseRange(self.__dict__["_probe"], name, self._label(index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # a DataParallel inside a replica (on a CPU worker) is part of that replica's apply, which the outer call times:
        # it opens no step and records nothing of its own
        run = current_run() if not on_worker_thread() else None
        if run is None:
            with profiler_range("DataParallel.forward"):
                output = self._forward(inputs, kwargs)
                # torch's own fast check of "a profiler is on" (all-threads profiling included)
                if self._watch_backward and profiler_on():
                    watch_backward(output, None, HOST_LABEL)  # the dpprof.backward range, untimed
                return output
        devices = self.__dict__["_devices"]
        out_label = self._label(devices.output_index) if devices is not None else HOST_LABEL
        # the probe first, then the range: a call that starts a step may start (or stop) a deep capture's
        # torch.profiler there (dpprof.capture), and torch's fast range must not span that (entered with no
        # profiler, it cannot be exited with one: an internal assert). torch sets no dim when there are no devices
        module = self._modules["module"]  # not self.module: Module.__getattr__ is a Python call, twice a step
        probe = ForwardProbe(run, devices or _HOST, out_label, getattr(self, "dim", 0), self._starts_step,
                             root=module)
        with profiler_range("DataParallel.forward"):
            self.__dict__["_probe"] = probe
            try:
                output = self._forward(inputs, kwargs)
            except BaseException:
                self.__dict__["_probe"] = None
                end_after_error(probe, module)
                raise
            self.__dict__["_probe"] = None
            probe.end(module)
            if self._watch_backward:
                probe.watch_backward(output)
            return output

    def _forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch's DataParallel.forward, except that the one-device and no-device paths
        # also run their module call as a measured "apply" phase.
        probe = self.__dict__["_probe"]
        if not self.device_ids:  # nothing is scattered: the step's batch is noted here
            if probe is not None:
                probe.note_batch(inputs, kwargs)
            return MeasuredReplica(self.module, probe, HOST_LABEL)(*inputs, **kwargs)
        misplaced = _first_misplaced(self.module, self.src_device_obj)
        if misplaced is not None:
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {self.src_device_obj} (device_ids[0]) but found one of "
                f"them on device: {misplaced}"
            )
        inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if not inputs and not module_kwargs:
            inputs = ((),)
            module_kwargs = ({},)
        if len(self.device_ids) == 1:
            replica = MeasuredReplica(self.module, probe, self._label(self.device_ids[0]))
            return replica(*inputs[0], **module_kwargs[0])
        if self.training and "_rng_checked" not in self.__dict__ and self.__dict__["_devices"].type == "cpu":
            _say_shared_generator(self.module, len(inputs))
            self.__dict__["_rng_checked"] = True  # once per DataParallel: a walk of the module, not one per step
        replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, module_kwargs)
        return self.gather(outputs, self.output_device)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                device_ids: Sequence[int]) -> Any:
        with self._phase("scatter", device_ids[0]):
            probe = self.__dict__["_probe"]
            if probe is not None:
                probe.note_batch(inputs, kwargs)
            return scatter_kwargs(inputs, kwargs, self._targets(device_ids), dim=self.dim)

    def replicate(self, module: Module, device_ids: Sequence[int]) -> list[Module]:
        with self._phase("replicate", device_ids[0]):
            return replicate(module, self._targets(device_ids), not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        device_ids = self.device_ids[: len(replicas)]
        probe = self.__dict__["_probe"]
        measured = [MeasuredReplica(r, probe, self._label(i), self._shared_args) for r, i in zip(replicas, device_ids)]
        with self._phase("parallel_apply", device_ids[0]):
            return parallel_apply(measured, inputs, kwargs, self._targets(device_ids))

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        index = device_index(output_device)
        with self._phase("gather", index):
            output = gather(outputs, self._output_target(index), dim=self.dim)
            probe = self.__dict__["_probe"]
            if probe is not None:
                probe.note_gathered(output)
            return output


def data_parallel(module: Module, inputs: Any, device_ids: Sequence[DeviceLike] | None = None,
                  output_device: DeviceLike | None = None, dim: int = 0,
                  module_kwargs: Any | None = None) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel over device_ids: torch's data_parallel.

    Args:
        module: the module to evaluate; its parameters and buffers must be on device_ids[0].
        inputs: a tensor, or a tuple of positional inputs.
        device_ids: CUDA devices or CPU workers (default: every GPU).
        output_device: where the result is gathered (default: device_ids[0]).
        dim: the dimension to chunk and concatenate along.
        module_kwargs: keyword inputs, scattered like the positional ones.

    Returns:
        the gathered result of ``module`` on output_device.
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is None:
        if not torch.cuda.is_available():
            raise RuntimeError("device type could not be determined")
        device_ids = list(range(torch.cuda.device_count()))
    devices = resolve_devices(device_ids, output_device)
    return DataParallel._functional(module, devices, dim)(*inputs, **(module_kwargs or {}))
