"""What one recorded forward call measures: phase times, per-device bytes, backward, allocator.

Nothing here blocks on the GPU: CUDA events are read after the fact (Run.resolve_pending)
unless the run asked for synchronous timing.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from itertools import chain
from typing import Any, Callable, Protocol

import torch
from torch.nn import Module

from dpprof.device_ids import DeviceSet
from dpprof.parallel.ranges import profiler_range
from dpprof.recording import Run
from dpprof.records import MEMORY_ROW, PHASE_ROW, AllocatorRecord

__all__ = ["ForwardProbe", "MeasuredReplica", "end_after_error", "PendingPhase", "tensor_bytes", "iter_tensors", "watch_backward",
           "allocator_bytes", "event_now", "cuda_event", "gpu_of", "rank_part", "on_gradient"]


def _dataclass_values(obj: Any) -> list[Any] | None:
    """A dataclass instance's field values (torch's DDP finds a model's output tensors in them too), else None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    else:
        values = _dataclass_values(obj)
        if values is not None:
            yield from iter_tensors(values)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside ``obj`` (numel × element size; views counted at their own size).

    A plain recursion rather than a sum over iter_tensors, a container's tensors counted without a call of their
    own: this runs several times a step."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()  # not .nbytes: sparse tensors refuse it
    total = 0
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        items = _dataclass_values(obj)
        if items is None:
            return 0
    for item in items:
        total += item.numel() * item.element_size() if isinstance(item, torch.Tensor) else tensor_bytes(item)
    return total


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first tensor of ``args`` then ``kwargs`` (iter_tensors' order); a leading tensor without a walk."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return next(chain(iter_tensors(args), iter_tensors(kwargs)), None)


# Calls alike (same replica place, module, input shapes and modes) save the same activations in
# all but data-dependent models: count them with per-tensor hooks once, then once every this many
# calls, to keep per-tensor Python off most steps while still catching a model that varies.
ACTIVATIONS_RECOUNT_EVERY = 50


def _signature(obj: Any) -> Any:
    """The shapes and dtypes of the tensors inside ``obj`` (what activations depend on, data aside), in
    its nesting; anything else is None."""
    if isinstance(obj, torch.Tensor):
        return obj.shape, obj.dtype
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(item) for item in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    return None


def _cuda_index(label: str) -> int | None:
    kind, _, index = label.partition(":")
    return int(index) if kind == "cuda" else None


# Timing events are reused once read, and the current stream's object is looked up by its raw
# handle: creating an event and building a Stream object cost more than recording an event.
_free_events: dict[int, list[torch.cuda.Event]] = {}
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # in CUDA builds of torch only


def cuda_event(index: int | None) -> torch.cuda.Event | None:
    """A timing event recorded now on GPU ``index``'s current stream (None for no GPU: a CPU label or rank)."""
    return None if index is None else event_now(index)


def event_now(index: int) -> torch.cuda.Event:
    """A timing event recorded now on GPU ``index``'s current stream."""
    free = _free_events.get(index)
    event = free.pop() if free else torch.cuda.Event(enable_timing=True)
    if _raw_stream is None:
        stream = torch.cuda.current_stream(index)
    else:
        raw = _raw_stream(index)
        cached = _streams.get((index, raw))
        if cached is None:
            cached = _streams[(index, raw)] = torch.cuda.current_stream(index)
        stream = cached
    event.record(stream)
    return event


def _release_events(index: int, *events: torch.cuda.Event) -> None:
    """Events whose times have been read, for cuda_event to record again."""
    _free_events.setdefault(index, []).extend(events)


# Where the caching allocator is read (one read costs ~20 us): at the end of each replica's apply, on
# its device (the forward's activations are held then), and at the end of backward, on every device.
# Its peak counts from the step's first forward call, so these reads see every phase's peak.
_ALLOCATOR_READS = {"apply": False, "backward": True}  # phase -> every device (else the phase's own)


def allocator_bytes(index: int) -> tuple[int, int, int]:
    """(allocated, peak allocated, reserved) bytes of the caching allocator on one GPU, from one read
    of its counters: torch.cuda.memory_allocated and its siblings each flatten and sort every
    statistic the allocator keeps, which costs ~100 us a call."""
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return allocated["current"], allocated["peak"], reserved["current"]


def _weight_storages(module: Module) -> set[int]:
    """Storage addresses of a module's (or replica's) parameters and buffers."""
    ptrs = set()
    for m in module.modules():
        params = getattr(m, "_former_parameters", None) or m._parameters
        for t in chain(params.values(), m._buffers.values()):
            if t is not None:
                ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


class PendingPhase:
    """A phase whose CUDA events may still be in flight: its row (dpprof.records.Row) but for the GPU time, which
    is read once its end event has completed."""

    __slots__ = ("row", "index", "start", "end", "release")

    def __init__(self, row: tuple[Any, ...], index: int, start: torch.cuda.Event, end: torch.cuda.Event,
                 release: bool = True) -> None:
        # row: (PHASE_ROW, step, call, phase, device, start_ms, duration_ms), PhaseRecord's fields but the last
        self.row, self.index, self.start, self.end = row, index, start, end
        self.release = release  # False: the events are shared with another phase (a DDP rank's), not reused

    def try_emit(self, run: Run, block: bool) -> bool:
        if block:
            self.end.synchronize()
        elif not self.end.query():
            return False
        run.sink.put((*self.row, self.start.elapsed_time(self.end)))
        if self.release:
            _release_events(self.index, self.start, self.end)
        return True


def gpu_of(module: Module) -> int | None:
    """The index of the GPU a module's parameters are on (its first parameter's; a DTensor's, its shard's), or None."""
    first = next(module.parameters(), None)
    return first.device.index if first is not None and first.device.type == "cuda" else None


def rank_part(run: Run, step: int, name: str, label: str, t0: int, t1: int, cuda_index: int | None,
              ev0: torch.cuda.Event | None = None, ev1: torch.cuda.Event | None = None) -> None:
    """One part of a DDP or FSDP rank's step, from host time ``t0`` to ``t1`` (perf_counter_ns): emitted now, or, on
    a GPU with CUDA events at both its ends, once they complete, with its GPU time (Run.resolve_pending). One part's
    end event is the next part's start, so these events are not reused."""
    start_ms, duration_ms = (t0 - run._t0_ns) / 1e6, (t1 - t0) / 1e6
    if ev0 is not None and ev1 is not None and cuda_index is not None:
        run.defer(PendingPhase((PHASE_ROW, step, 0, name, label, start_ms, duration_ms), cuda_index, ev0, ev1,
                               release=False))
    else:  # a row (dpprof.records.Row): PHASE_ROW, then PhaseRecord's fields in order
        run.sink.put((PHASE_ROW, step, 0, name, label, start_ms, duration_ms, None))


_RAW_SAVED: dict[type, tuple[str, ...]] = {}  # a graph node's class -> its saved-variable attributes ("_raw_saved_*")


def _raw_saved_names(node: Any) -> tuple[str, ...]:
    cls = type(node)
    names = _RAW_SAVED.get(cls)
    if names is None:
        names = _RAW_SAVED[cls] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    return names


def saved_bytes(output: Any, before: Any, exclude: set[int]) -> int:
    """Bytes of the tensors autograd saved for backward in the graph a call built: from ``output``'s nodes back to
    those of ``before`` (the call's inputs and weights, made before it), each tensor once, ``exclude``'s storages
    (the weights) not counted.

    Read from the graph's saved variables after the call, never with saved-tensor hooks around it: those turn off
    autograd's check that a saved tensor was not modified in place, torch.func refuses them, and a hook that keeps
    a saved output keeps its graph alive until the collector runs. A variable saved with hooks of its own
    (activation checkpointing, offloading) is not held as such, and is not counted."""
    stop = {t.grad_fn for t in iter_tensors(before) if t.grad_fn is not None}
    stack: list[Any] = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
    visited: set[Any] = set()
    seen: set[tuple[int, int]] = set()
    total = 0
    while stack:
        node = stack.pop()
        if node is None or node in visited or node in stop:
            continue
        visited.add(node)
        for name in _raw_saved_names(node):
            try:
                raw = getattr(node, name)
            except RuntimeError:  # released
                continue
            for variable in raw if isinstance(raw, (list, tuple)) else (raw,):
                if not hasattr(variable, "unpack_hook") or variable.unpack_hook is not None:
                    continue
                try:
                    t = variable.data
                except RuntimeError:  # an undefined or released tensor
                    continue
                if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in exclude:
                    continue
                key = (t.data_ptr(), t.numel())
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
        stack.extend(fn for fn, _ in node.next_functions)
    return total


class _PassWatch:
    """Calls ``start`` at the first gradient of each backward pass that reaches any of the tensors it watches, and
    ``end`` when that pass ends; a second pass through the same graph (retain_graph) is one of its own."""

    __slots__ = ("start", "end", "seen")

    def __init__(self, start: Callable[[], None], end: Callable[[], None] | None) -> None:
        self.start, self.end, self.seen = start, end, False

    def on_grad(self, grad: Any) -> None:
        """A tensor hook's gradient, or a graph node's pre-hook's gradients (on_gradient): nothing is returned, so
        nothing is changed."""
        if self.seen:
            return
        self.seen = True
        self.start()
        torch.autograd.Variable._execution_engine.queue_callback(self.on_done)

    def on_done(self) -> None:
        self.seen = False
        if self.end is not None:
            self.end()


def watch_passes(tensors: list[torch.Tensor], start: Callable[[], None],
                 end: Callable[[], None] | None = None) -> None:
    """Call ``start`` when a backward pass first reaches any of ``tensors`` (each must require grad), and ``end``
    once that pass ends."""
    watch = _PassWatch(start, end)
    for t in tensors:
        on_gradient(t, watch.on_grad)


class _BackwardWatch:
    """The dpprof.backward range from the first gradient reaching the output to the end of the graph
    task; inside a run, also its timing."""

    __slots__ = ("probe", "label", "t0", "ev0", "range")

    def __init__(self, probe: ForwardProbe | None, label: str) -> None:
        self.probe, self.label = probe, label
        self.t0: int | None = None
        self.ev0: torch.cuda.Event | None = None
        self.range: Any = None

    def start(self) -> None:
        self.range = profiler_range("dpprof.backward")
        self.range.__enter__()
        self.t0 = time.perf_counter_ns()
        if self.probe is not None and self.probe.cuda_indices:
            self.ev0 = cuda_event(_cuda_index(self.label))

    def end(self) -> None:
        t0, ev0, span, self.t0, self.ev0, self.range = self.t0, self.ev0, self.range, None, None, None
        if self.probe is not None and t0 is not None:  # timed before the range closes: the timer lies inside it
            self.probe.finish_backward(self.label, t0, ev0)
        if span is not None:
            span.__exit__(None, None, None)


def watch_backward(output: Any, probe: ForwardProbe | None, label: str) -> None:
    """Open a dpprof.backward range when the first gradient reaches ``output``, closed when backward
    ends, and time it when ``probe`` is given."""
    if not torch.is_grad_enabled():
        return
    if isinstance(output, torch.Tensor):  # most models' output: no walk
        tensors = [output] if output.requires_grad else []
    else:
        tensors = [t for t in iter_tensors(output) if t.requires_grad]
    if tensors:
        watch = _BackwardWatch(probe, label)
        watch_passes(tensors, watch.start, watch.end)


_LEAF_HOOKS: dict[int, Any] = {}  # id of a leaf tensor -> the handle of on_gradient's hook on it


def on_gradient(tensor: torch.Tensor, hook: Callable[[Any], None]) -> None:
    """Call ``hook`` when backward next reaches ``tensor`` (it must require grad): a pre-hook of the graph node that
    made it, which runs at that moment, goes with the graph, and costs ~3 us less a step than a tensor hook (no handle
    dict on the tensor); it runs after the tensor's own hooks. ``hook`` gets the gradient or gradients and returns
    None: it changes nothing.

    A leaf (a module that returns its own parameter) has no node, and a tensor hook stays on it: each forward's
    would fire in every later backward. Its hook is the leaf's one (a forward's replaces the last's, so forwards with
    no backward between them are timed once) and is removed once the backward it fired in ends."""
    node = tensor.grad_fn
    if node is not None:
        node.register_prehook(hook)
        return
    key = id(tensor)
    old = _LEAF_HOOKS.pop(key, None)
    if old is not None:
        old.remove()

    def remove() -> None:
        handle.remove()
        if _LEAF_HOOKS.get(key) is handle:
            del _LEAF_HOOKS[key]

    def once(grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(remove)  # at the backward's end, not in its hooks
        hook(grad)

    handle = _LEAF_HOOKS[key] = tensor.register_hook(once)


class ForwardProbe:
    """Measurements of one DataParallel forward call inside a run."""

    def __init__(self, run: Run, devices: DeviceSet, output_label: str, dim: int, starts_step: bool = True,
                 root: Module | None = None) -> None:
        self.run = run
        self.put = run.sink.put  # what run.emit calls, one call less on every record
        self.t0_ns = run._t0_ns  # the run's clock origin (run.ms)
        self.root = root  # the module the replicas are made from
        self.step = run.step_for_forward(starts_step, root)
        self.call = self.step.calls - 1
        # a backward ended in this step before this call (gradient accumulation): the micro-batches do not coexist, so
        # the step's memory is its first pass's (what a later one holds is not added to it)
        self.later_pass = self.step.passes > 0
        self.dim = dim
        self.output_label = output_label
        self.cuda_indices = list(devices.indices) if devices.type == "cuda" else []
        # device label -> [chunk_size, input_bytes, output_bytes, activation_bytes, gathered_bytes, a replica ran]
        self.memory: dict[str, list[Any]] = {}
        # what each replica's call held, noted by its worker and counted by end() on the calling
        # thread: byte counts are Python, and on a worker they would contend with the other replicas
        self.applied: list[tuple[Any, ...]] = []
        # (site, mode, input signature) -> [activation bytes, calls before a recount] (call_counting_activations)
        self.activation_counts: dict[Any, list[int]] = run.cached("activation counts", dict)
        run.note_devices(devices)
        if self.call == 0:
            for index in self.cuda_indices:
                torch.cuda.reset_peak_memory_stats(index)

    # time: a phase is start_event (CUDA only) and a host clock reading, then finish_phase
    def start_event(self, label: str) -> torch.cuda.Event | None:
        """A phase's starting CUDA event on the device ``label`` names (None on CPU workers or the host)."""
        return cuda_event(_cuda_index(label)) if self.cuda_indices else None

    def finish_phase(self, name: str, label: str, t0: int, ev0: torch.cuda.Event | None) -> None:
        if not self.cuda_indices:  # CPU workers or the host: a host time, nothing to wait for
            t1 = time.perf_counter_ns()
            step = self.step
            if t1 > step.last_end_ns:
                step.last_end_ns = t1
            # a row (dpprof.records.Row): PHASE_ROW, then PhaseRecord's step, call, phase, device, start_ms,
            # duration_ms, device_duration_ms
            self.put((PHASE_ROW, step.index, self.call, name, label, (t0 - self.t0_ns) / 1e6, (t1 - t0) / 1e6, None))
            return
        run = self.run
        index = _cuda_index(label)
        if index is not None and run.sync_timing:
            torch.cuda.synchronize(index)
        t1 = time.perf_counter_ns()
        step = self.step
        step.touch(t1)
        row = (PHASE_ROW, step.index, self.call, name, label, (t0 - self.t0_ns) / 1e6, (t1 - t0) / 1e6)
        if ev0 is None or index is None:  # the host's phases (an event is only started on a GPU's label)
            self.put((*row, None))
            return
        run.defer(PendingPhase(row, index, ev0, event_now(index)))
        every = _ALLOCATOR_READS.get(name)
        if every is None:
            return
        for i in self.cuda_indices if every else (index,):
            allocated, peak, reserved = allocator_bytes(i)
            self.put(AllocatorRecord(step.index, self.call, f"cuda:{i}", name, allocated, peak, reserved))

    def finish_backward(self, label: str, t0: int, ev0: torch.cuda.Event | None) -> None:
        """Time a backward pass through this call's output in the step it ran in: the call's own, or, where that step
        has ended, the step open now (a GAN's generator, called in the discriminator's step and backpropagated through
        the discriminator in its own step after), as the step's newest call's."""
        if self.step.closed:
            now = self.run.open_step()
            if now is not None:
                self.step, self.call = now, max(now.calls - 1, 0)
        self.finish_phase("backward", label, t0, ev0)
        self.step.passes += 1

    def weight_storages(self, module: Module) -> set[int]:
        """Storages of a module's weights: a replica's own (broadcast copies on GPUs, copies or views
        of the module on CPU workers); a persistent module's computed once per run."""
        if getattr(module, "_is_replica", False):
            return _weight_storages(module)
        return self.run.cached(("weight storages", id(module)), lambda: _weight_storages(module))

    def call_counting_activations(self, fn: Callable[..., Any], weights: Module, args: Any,
                                  kwargs: dict[str, Any], site: Any = None) -> tuple[Any, int]:
        """``fn(*args, **kwargs)`` and the bytes of the activations autograd saved during it (0 without grad),
        ``weights``' own tensors not counted.

        With ``site`` (what makes calls alike: the replica's place and module), the bytes are counted
        from the graph (saved_bytes) on the first call of each input signature (shapes, dtypes, grad and
        training mode) and again every ACTIVATIONS_RECOUNT_EVERY calls; in between the count is reused,
        and a signature whose recount ever differs (a model whose saved tensors depend on the data) is
        counted on every call from then on.
        """
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs), 0
        counts = None
        if site is not None:
            # one tensor and no keywords (most calls) without a walk: the key is what _signature gives them
            first = args[0] if len(args) == 1 else None
            key = (site, weights.training,
                   ((first.shape, first.dtype),) if type(first) is torch.Tensor else _signature(args),
                   _signature(kwargs) if kwargs else ())
            counts = self.activation_counts
            known = counts.get(key)
            if known is not None and known[1] > 0:
                known[1] -= 1
                return fn(*args, **kwargs), known[0]
        output = fn(*args, **kwargs)
        nbytes = saved_bytes(output, (args, kwargs, [p for p in weights.parameters() if p.grad_fn is not None]),
                             self.weight_storages(weights))
        if counts is not None:
            known = counts.get(key)
            alike = known is None or (known[1] >= 0 and known[0] == nbytes)
            # [bytes, calls left before a recount]; -1: this signature saved other bytes once, so count it every call
            counts[key] = [nbytes, ACTIVATIONS_RECOUNT_EVERY - 1 if alike else -1]
        return output, nbytes

    # bytes
    def note_batch(self, inputs: Any, kwargs: Any) -> None:
        """Add this call's samples to the step's batch where the call is of the step's first module (_Step.batch_of):
        gradient accumulation's micro-batches add up, a second model's calls (a GAN's) do not."""
        first = _first_tensor(inputs, kwargs)
        # a dim out of the tensor's range is left to the scatter, which raises torch's IndexError naming the shape
        if first is not None and -first.dim() <= self.dim < first.dim():
            self.step.add_batch(id(self.root) if self.root is not None else 0, first, first.size(self.dim))

    def note_device(self, label: str, args: Any, kwargs: Any, output: Any, activation_bytes: int,
                    shared_args: int = 0, chunked: bool = True) -> None:
        if self.later_pass:  # a later micro-batch's bytes are not the step's (end): not counted at all
            return
        first = (args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)) if chunked \
            else None
        chunk_size = first.size(self.dim) if first is not None and first.dim() > 0 else None
        inputs = args[shared_args:] if shared_args else args
        if not kwargs and len(inputs) == 1 and type(inputs[0]) is torch.Tensor:  # most replicas' input: no walk
            input_bytes = inputs[0].numel() * inputs[0].element_size()
        else:
            input_bytes = tensor_bytes((inputs, kwargs) if kwargs else inputs)
        output_bytes = output.numel() * output.element_size() if type(output) is torch.Tensor else tensor_bytes(output)
        cell = self.memory.get(label)
        if cell is None:
            self.memory[label] = [chunk_size, input_bytes, output_bytes, activation_bytes, 0, True]
        else:  # the output device's gathered bytes are noted first where the call ran no replica on it
            cell[:4], cell[5] = (chunk_size, input_bytes, output_bytes, activation_bytes), True

    def note_gathered(self, output: Any) -> None:
        cell = self.memory.get(self.output_label)
        if cell is None:
            self.memory[self.output_label] = [None, 0, 0, 0, tensor_bytes(output), False]
        else:
            cell[4] = tensor_bytes(output)

    def end(self, module: Module, used: int | None = None) -> None:
        """Close the forward call: count what each replica held and emit each device's memory record.

        ``used``: replicas that ran (default: the devices that held something)."""
        if self.later_pass:  # a later micro-batch: the step's memory is its first pass's, and this call adds none
            used = max(len(self.applied), 1) if used is None else used
            self.step.devices_used = max(self.step.devices_used, used)
            self.applied.clear()
            return
        for applied in self.applied:
            self.note_device(*applied)
        self.applied.clear()
        used = max(len(self.memory), 1) if used is None else used
        self.step.devices_used = max(self.step.devices_used, used)
        param_bytes, buffer_bytes = self.run.cached(("weight bytes", id(module)), lambda: (
            sum(p.numel() * p.element_size() for p in module.parameters()),
            sum(b.numel() * b.element_size() for b in module.buffers())))
        weighed, key = self.step.weighed, id(module)
        if weighed is None:  # the step's first call: its module's weights are counted
            self.step.weighed = (key,)
        elif key in weighed:  # a module called again in the step holds its weights once
            param_bytes = buffer_bytes = 0
        else:
            self.step.weighed = (*weighed, key)
        step, call, put = self.step.index, self.call, self.put
        for label, (chunk_size, input_bytes, output_bytes, activation_bytes, gathered_bytes, held) in \
                self.memory.items():
            # held: a replica ran here (else only the gathered output is). A row (dpprof.records.Row): MEMORY_ROW, then
            # DeviceMemoryRecord's step, call, device, chunk_size, input_bytes, output_bytes, activation_bytes,
            # gathered_bytes, param_bytes, buffer_bytes
            put((MEMORY_ROW, step, call, label, chunk_size, input_bytes, output_bytes, activation_bytes, gathered_bytes,
                 param_bytes if held else 0, buffer_bytes if held else 0))

    def watch_backward(self, output: Any) -> None:
        watch_backward(output, self, self.output_label)


class _EndsForward(Protocol):
    """What end_after_error closes: a DataParallel's or DDP rank's ForwardProbe, or an FSDP rank's step probe."""

    step: Any  # the call's step (dpprof.recording's), which counts its raised_calls

    def end(self, module: Module, used: int | None = None) -> None: ...


def end_after_error(probe: _EndsForward, module: Module, used: int | None = None) -> None:
    """``probe.end`` after a forward call that raised, counted in its step's raised_calls (a script that catches the
    error and goes on, skipping an out-of-memory batch, leaves a step of forward phases and no backward that trained
    nothing): that call's error is the one the caller sees, so an end that fails on what the call left (a lazy
    module's weights never made) is dropped, never raised in its place."""
    probe.step.raised_calls += 1
    try:
        probe.end(module, used)
    except Exception:  # noqa: BLE001 - the forward's own error is being raised
        pass


class MeasuredReplica:
    """A replica as parallel_apply calls it: inside a dpprof.apply range, measured when recording."""

    __slots__ = ("module", "probe", "label", "shared_args", "phase", "range_name")

    def __init__(self, module: Module, probe: ForwardProbe | None, label: str,
                 shared_args: int = 0, phase: str = "apply") -> None:
        self.module, self.probe, self.label = module, probe, label
        self.shared_args = shared_args  # leading args already counted elsewhere (a model's outputs)
        self.phase, self.range_name = phase, f"dpprof.{phase}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with profiler_range(self.range_name):
            probe = self.probe
            if probe is None:
                return self.module(*args, **kwargs)
            ev0 = probe.start_event(self.label) if probe.cuda_indices else None
            t0 = time.perf_counter_ns()
            try:
                output, activation_bytes = probe.call_counting_activations(
                    self.module, self.module, args, kwargs, site=(self.label, self.phase, id(probe.root)))
            finally:
                probe.finish_phase(self.phase, self.label, t0, ev0)
            probe.applied.append((self.label, args, kwargs, output, activation_bytes, self.shared_args,
                                  self.phase == "apply"))
            return output
