"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and FSDP1 (``FullyShardedDataParallel``) recorded per rank, through
the hooks torch's FSDP already calls.

Nothing of torch's FSDP is copied: ``install()`` wraps, in place and reversibly, the few functions FSDP2 calls
for each step (the root's pre-forward, the root's post-forward registration of its pre-backward hook, the root's
post-backward callback, the parameter groups' unshard wait and reshard, and the three collective helpers they call:
``foreach_all_gather``, ``foreach_all_gather_copy_out``, ``foreach_reduce``), and the collective object each helper
is handed, so the collective call itself is timed.
For FSDP1, the class's ``forward`` (the outermost call is the root's), the runtime's pre-backward hook and
post-backward final callback, ``FlatParamHandle._all_gather_flat_param`` and ``_free_unsharded_flat_param``, and the
reduce-scatter the runtime calls and NO_SHARD's gradient all-reduce (through its module's ``dist``, which alone is
wrapped). FSDP1 has one flat parameter per FSDP module and no separate copy-in or copy-out: those parts stay empty.
Outside a recording the wrappers call torch's functions and do nothing else.

What is measured per rank and step, on the host clock (``time.perf_counter_ns``):

- ``forward``: the root module's forward, from its pre-forward hook to its post-forward hook (where the root
  registers its pre-backward hook, after resharding its own parameters);
- ``backward``: the first gradient reaching the root's output to the end of FSDP's root post-backward callback;
- ``all_gather_wait`` / ``reduce_scatter_wait``: the time the rank's host was blocked in the collective: inside a
  synchronous collective call (gloo, and every FSDP2 reduce-scatter), or in ``Work.wait()`` before the copy-out of an
  asynchronous all-gather. This is the *exposed* part: on CPU gloo every FSDP2 collective is synchronous, so it
  all is. On a GPU (NCCL) the host only enqueues the collective, so the host's exposed time is the launch and the
  collective's own time is on the GPU (import a torch.profiler trace for it);
- ``copy_in`` / ``copy_out``: FSDP's copies around the collectives: the all-gather's copy-in of the local shards
  and its copy-out into the unsharded parameters, the reduce-scatter's copy-in of the gradients and what follows
  the collective (the gradient copied into the sharded ``.grad``);
- ``optimizer``: ``optimizer.step()`` (torch's global optimizer hooks);
- ``data``: the gap since the previous step ended (data loading), as for DDP.

On a rank whose module is on a GPU, ``data``, ``forward``, ``backward`` and ``optimizer`` also get their time on the
GPU (``device_duration_ms``) from CUDA events recorded on the current stream at their ends, read once they complete
(the step never waits for them), as DDP's parts do. Backward's GPU time ends after FSDP's root post-backward callback,
which makes the current stream wait for the last reduce-scatter. The collectives and copies keep their host times
only: FSDP runs them on its own streams, where an event on the current stream would time something else.

Each collective is also one ``CommRecord`` (``collective`` "all-gather" or "reduce-scatter"): its bytes (the
all-gather's whole output, the reduce-scatter's whole input: both the padded unsharded size of the group's
parameters), its launch and its completion (the end of the call for a synchronous one; the end of ``wait()`` for an
asynchronous all-gather: when the rank learned it was done). ``bucket`` is its index among the step's
collectives of its kind, the order the collectives engineer's per-collective matching reads.

Memory on CPU is dpprof's accounting, one ``DeviceMemoryRecord`` per rank and step: ``param_bytes`` the rank's
sharded parameters, ``gathered_bytes`` the peak of the unsharded (gathered) parameters the rank held at once in
the step, ``input_bytes`` / ``output_bytes`` the root forward's. On a GPU the allocator's counters are recorded
too (``AllocatorRecord`` at the end of forward and of backward).
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dpprof.loaders import take as loader_calls
from dpprof.device_ids import rank_devices
from dpprof.parallel import script_comms
from dpprof.parallel.callers import WarningsPastDpprof
from dpprof.parallel.probe import (allocator_bytes, cuda_event, end_after_error, gpu_of, iter_tensors, rank_part,
                                   tensor_bytes)
from dpprof.recording import RELEASE_HOOKS, Run, current_run
from dpprof.records import ALL_REDUCE, COMM_ROW, MEMORY_ROW, PHASE_ROW, AllocatorRecord

__all__ = ["install", "uninstall", "installed", "FSDP_WAIT_PHASES", "ALL_GATHER", "REDUCE_SCATTER"]

ALL_GATHER = "all-gather"  # CommRecord.collective, in dpprof.trace.collect.collective_name's words
REDUCE_SCATTER = "reduce-scatter"
FSDP_WAIT_PHASES = {ALL_GATHER: "all_gather_wait", REDUCE_SCATTER: "reduce_scatter_wait"}

_lock = threading.Lock()
_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, torch's original), to put back
_state: dict[str, Any] = {"probe": None, "previous": None, "hooks": []}


def _release(run: Run) -> None:
    """The run closed: its last step's probe (which holds the root module) is let go."""
    for key in ("probe", "previous"):
        if _state[key] is not None and _state[key].run is run:
            _state[key] = None


RELEASE_HOOKS.append(_release)


class _StepProbe:
    """One recorded FSDP step on one rank."""

    def __init__(self, run: Run, rank: int, module: torch.nn.Module, t0: int, previous: _StepProbe | None,
                 shard_bytes: Callable[[torch.nn.Module], tuple[int, int]] | None = None,
                 ev0: torch.cuda.Event | None = None) -> None:
        self.run = run
        self.put = run.sink.put  # what run.emit calls, one call less on each of the step's ~50 records
        self.t0_ns = run._t0_ns  # the run's clock origin (run.ms)
        self.shard_bytes = shard_bytes or _shard_bytes  # FSDP2's DTensor shards, or FSDP1's flat parameters'
        self.gathered_handles: dict[int, int] = {}  # FSDP1: id(FlatParamHandle) -> its bytes, while gathered
        self.devices = rank_devices(rank)
        self.label = self.devices.label(rank)
        run.note_devices(self.devices)
        self.step = run.step_for_forward(True, module)
        # a deep capture started or stopped as the step was made, after the root's forward began: the step and its
        # forward begin after it, as its clock does (the root's pre-forward before it, lazy init after the first step's,
        # is left out)
        t0 = max(t0, run.capture_turned_ns)
        if not self.step.explicit and self.step.calls == 1:
            # the root's forward began (t0) before this probe made its step: the step begins no later, or the first
            # step (no previous step's end to start from) would hold less than its own forward
            self.step.start_ns = min(self.step.start_ns, t0)
        self.module = module
        self.cuda_index = _gpu_of(module)
        if self.cuda_index is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda_index)
        self.forward_t0 = t0
        self.forward_ev0 = ev0  # on a GPU: CUDA events at the parts' starts (the GPU's view of them)
        self.forward_ended = False  # the root's forward returned (forward_done), or raised (end)
        self.backward_t0: int | None = None
        self.backward_ev0: torch.cuda.Event | None = None
        self.optimizer_t0: int | None = None
        self.optimizer_ev0: torch.cuda.Event | None = None
        self.optimizer_depth = 0  # optimizer steps begun and not ended (_optimizer_pre): the outer one is the part
        self.last_end_ns = t0
        self.last_end_event: torch.cuda.Event | None = None  # the newest part's end on the GPU, where it has one
        self.count = {ALL_GATHER: 0, REDUCE_SCATTER: 0, ALL_REDUCE: 0}
        self.pending: dict[int, tuple[int, int, int]] = {}  # id(AllGatherResult) -> (index, bytes, launch_ns)
        self.gathered_bytes = 0
        self.gathered_peak_bytes = 0
        self.io_bytes = (0, 0)
        self.step.on_close = self.if_raised  # the step's newest root forward: an earlier one's was told here
        if previous is not None and previous.run is run:
            if previous.step is self.step:  # a later micro-batch of the step: its collectives' indexes go on
                self.count = dict(previous.count)
            step, data_start = self.step, max(previous.last_end_ns, run.capture_turned_ns)
            if not step.explicit and step.calls == 1:
                step.start_ns = min(step.start_ns, data_start)
                step.loader_ms = None  # the DataLoader's time since the step before is its data part, in the step
            data_start = max(data_start, step.start_ns)
            # the script's collectives since the last step are this step's (held since then), and no part of its data
            held = script_comms.settle(run, step, step.start_ns) if step.calls == 1 else []
            pieces = script_comms.data_pieces(data_start, t0, held, loader_calls(data_start, t0))
            if pieces is not None:  # the DataLoader's calls, around the script's collectives: host time alone
                for a, b in pieces:
                    self.phase("data", a, b)
            elif t0 > data_start:
                # on a GPU, from the previous step's last part's end there (not from an explicit step's start)
                data_ev0 = previous.last_end_event if data_start == previous.last_end_ns else None
                self.phase("data", data_start, t0, data_ev0, ev0)
        elif self.step.calls == 1:  # the first step: what the script called before it is in no step
            script_comms.settle(run, self.step, self.step.start_ns)
        if not run.records_comms:
            script_comms.install(run)
            run.records_comms = True

    def event(self) -> torch.cuda.Event | None:
        """A CUDA timing event recorded now on this rank's GPU's current stream (None for a rank on the CPU)."""
        return cuda_event(self.cuda_index)

    def phase(self, name: str, t0: int, t1: int, ev0: torch.cuda.Event | None = None,
              ev1: torch.cuda.Event | None = None) -> None:
        """A part from host time t0 to t1; with its CUDA events (a rank on a GPU), its GPU time too (``rank_part``)."""
        if ev0 is None or ev1 is None or self.cuda_index is None:  # a host time: rank_part's, one call less
            # a row (dpprof.records.Row): PHASE_ROW, then PhaseRecord's step, call, phase, device, start_ms, duration_ms,
            # device_duration_ms
            self.put((PHASE_ROW, self.step.index, 0, name, self.label, (t0 - self.t0_ns) / 1e6, (t1 - t0) / 1e6, None))
        else:
            rank_part(self.run, self.step.index, name, self.label, t0, t1, self.cuda_index, ev0, ev1)
        step = self.step
        if t1 > step.last_end_ns:  # step.touch(t1)
            step.last_end_ns = t1
        if t1 > self.last_end_ns:
            self.last_end_ns, self.last_end_event = t1, ev1

    def collective(self, what: str, nbytes: int, launch_ns: int, done_ns: int, index: int | None = None) -> None:
        """One collective's row (a CommRecord's; ``index``: its place among the step's of its kind, counted now if
        None)."""
        if index is None:
            index = self.count[what]
            self.count[what] = index + 1
        # a row: COMM_ROW, then CommRecord's step, device, bucket, bucket_bytes, launch_ms, duration_ms, collective
        self.put((COMM_ROW, self.step.index, self.label, index, nbytes, (launch_ns - self.t0_ns) / 1e6,
                  (done_ns - launch_ns) / 1e6, what))

    def exchange(self, what: str, t0: int, timed: _TimedComm, t1: int | None) -> None:
        """A synchronous collective's parts from FSDP's helper call that began at ``t0`` (and ended at ``t1``, where
        the helper's copy-out is its own part): its copy-in up to the launch, its wait (the call), its copy-out after
        it, and its collective's row. The three parts follow one another: this is what every all-gather on gloo and every
        reduce-scatter records, so it is written out rather than made of three phase() calls."""
        launch, done = timed.launch_ns, timed.done_ns
        assert launch is not None and done is not None
        put, label, index, t0_ns = self.put, self.label, self.step.index, self.t0_ns
        put((PHASE_ROW, index, 0, "copy_in", label, (t0 - t0_ns) / 1e6, (launch - t0) / 1e6, None))
        put((PHASE_ROW, index, 0, FSDP_WAIT_PHASES[what], label, (launch - t0_ns) / 1e6, (done - launch) / 1e6, None))
        end = done
        if t1 is not None:
            put((PHASE_ROW, index, 0, "copy_out", label, (done - t0_ns) / 1e6, (t1 - done) / 1e6, None))
            end = t1
        self.collective(what, timed.nbytes, launch, done)
        step = self.step
        if end > step.last_end_ns:
            step.last_end_ns = end
        if end > self.last_end_ns:
            self.last_end_ns, self.last_end_event = end, None

    def gathered(self, delta_bytes: int) -> None:
        self.gathered_bytes = max(0, self.gathered_bytes + delta_bytes)
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)

    def read_allocator(self, phase: str) -> None:
        if self.cuda_index is not None:
            allocated, peak, reserved = allocator_bytes(self.cuda_index)
            self.run.emit(AllocatorRecord(self.step.index, 0, self.label, phase, allocated, peak, reserved))

    def forward_done(self, output: Any) -> None:
        """The root's forward ended with ``output``: its phase, output bytes and the allocator; under no_grad (no
        backward to come) the step's memory too."""
        self.forward_ended = True
        self.phase("forward", self.forward_t0, time.perf_counter_ns(), self.forward_ev0, self.event())
        self.io_bytes = (self.io_bytes[0], tensor_bytes(output))
        self.read_allocator("forward")
        self.step.devices_used = 1
        if not torch.is_grad_enabled():
            self.memory()
        told = self.run.forward_ended
        if told is not None:  # dpprof.instrument's step rule: a backward through it lets the next forward join
            told(output)

    def end(self, module: torch.nn.Module, used: int | None = None) -> None:
        """The root's forward raised (end_after_error, told at the next root forward, _open_step, or as its step
        closes, if_raised): its forward part runs to the last part recorded inside it, the error's moment being
        unknown."""
        self.forward_ended = True
        self.phase("forward", self.forward_t0, max(self.forward_t0, self.last_end_ns))
        self.step.devices_used = 1

    def if_raised(self) -> None:
        """As the step closes (its step's on_close): a root forward that never ended raised, and no later root forward
        counted it (the script's last forward, caught, the script ending; or a run.step() block's, closed first)."""
        if not self.forward_ended:
            end_after_error(self, self.module)

    def memory(self) -> None:
        """This rank's memory for the step by dpprof's accounting (sharded and peak gathered parameters), once a step:
        at its first backward's end (micro-batches of gradient accumulation do not coexist), or at its forward's under
        no_grad."""
        if self.step.passes:
            return
        self.step.passes += 1
        sharded, buffers = self.run.cached(("fsdp shard bytes", id(self.module)), lambda: self.shard_bytes(self.module))
        inputs, outputs = self.io_bytes
        # a row (dpprof.records.Row): MEMORY_ROW, then DeviceMemoryRecord's fields in order
        self.put((MEMORY_ROW, self.step.index, 0, self.label, self.step.batch_size, inputs, outputs, 0,
                  self.gathered_peak_bytes, sharded, buffers))


def _gpu_of(module: torch.nn.Module) -> int | None:
    """The index of the GPU a module's parameters are on (its first parameter's, a DTensor's local device), or None;
    looked up once per module."""
    found = module.__dict__.get("_dpprof_cuda", False)
    if found is False:
        found = module.__dict__["_dpprof_cuda"] = gpu_of(module)
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded parameters), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The FSDPParams of every fully_shard module in ``module`` (each group's of this torch: one or several)."""
    found = []
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        state = get_state() if callable(get_state) else None
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        found += [fp for group in groups for fp in group.fsdp_params]
    return found


def _shard_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) this rank holds of the module: its shards. Each FSDP parameter's is its sharded
    DTensor's local shard, read there: while a group is unsharded (between steps with reshard_after_backward=False,
    or under no_grad with reshard_after_forward=False) the module holds the whole unsharded parameter instead."""
    managed = _fsdp_params(module)
    held = {id(t) for fp in managed for t in (fp.sharded_param, fp.__dict__.get("_unsharded_param")) if t is not None}
    params = sum(_local(fp.sharded_param).numel() * fp.sharded_param.element_size() for fp in managed)
    params += sum(_local(p).numel() * p.element_size() for p in module.parameters() if id(p) not in held)
    return params, sum(b.numel() * b.element_size() for b in module.buffers())


def _gathered_itemsize(param: Any) -> int:
    """Bytes per element of an FSDPParam as it is gathered: its param_dtype under mixed precision, else its own."""
    dtype = getattr(param, "param_dtype", None) or param.sharded_param.dtype
    return int(dtype.itemsize)


def _group_unsharded_bytes(group: Any) -> int:
    """The bytes of an FSDP parameter group's parameters unsharded (gathered), unpadded, in the dtype they are gathered
    in (a MixedPrecisionPolicy's param_dtype, else their own); counted once per group: they do not change size."""
    found = group.__dict__.get("_dpprof_unsharded_bytes")
    if found is None:
        found = sum(p._orig_size.numel() * _gathered_itemsize(p) for p in group.fsdp_params)
        group.__dict__["_dpprof_unsharded_bytes"] = found
    return int(found)


class _TimedComm:
    """FSDP's collective object (DefaultAllGather, DefaultReduceScatter, ...) with its call timed."""

    __slots__ = ("inner", "bytes_of", "launch_ns", "done_ns", "nbytes", "result")

    def __init__(self, inner: Any, bytes_of: str) -> None:
        self.inner = inner
        self.bytes_of = bytes_of  # the keyword argument whose tensor the collective's bytes are
        self.launch_ns: int | None = None
        self.done_ns: int | None = None
        self.nbytes = 0
        self.result: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensor = kwargs.get(self.bytes_of)
        self.nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        self.launch_ns = time.perf_counter_ns()
        self.result = self.inner(*args, **kwargs)
        self.done_ns = time.perf_counter_ns()
        return self.result


def _probe() -> _StepProbe | None:
    """The current step's probe; None outside a recording, or once its run is no longer the current one."""
    probe: _StepProbe | None = _state["probe"]
    if probe is not None and current_run() is not probe.run:
        _state["probe"] = _state["previous"] = None
        return None
    return probe


def _open_step(run: Run, module: torch.nn.Module, t0: int, batch: Any, inputs: Any,
               shard_bytes: Callable[[torch.nn.Module], tuple[int, int]] | None = None,
               ev0: torch.cuda.Event | None = None) -> _StepProbe:
    """The probe of the step the root's forward (started at ``t0``, on a GPU at event ``ev0``) opens on this rank,
    made the current one: the batch size from ``batch``'s first tensor, the input bytes of ``inputs``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    previous = _state["previous"]
    if previous is not None and previous.run is run and not previous.forward_ended:
        # the previous root forward never reached its end: it raised, and the script went on (every rank skipping the
        # batch; FSDP2 starts a root forward again once reset_iter_state() recovers it): counted in its step's
        # raised_calls, as DataParallel's, before the step rule decides whether this forward joins that step
        end_after_error(previous, previous.module)
    probe = _StepProbe(run, rank, module, t0, previous if previous is not None and previous.run is run else None,
                       shard_bytes, ev0)
    first_tensor = next(iter_tensors(batch), None)
    if first_tensor is not None and first_tensor.dim() > 0:
        probe.step.add_batch(0, first_tensor, first_tensor.size(0))
    probe.io_bytes = (tensor_bytes(inputs), 0)
    _state["probe"] = _state["previous"] = probe
    return probe


def _starts_recorded(run: Run, module: torch.nn.Module, inputs: Any) -> bool:
    """Whether the root's forward now is recorded: ``run.forward_starting`` (dpprof run's) is told first, and may end
    the run there (--steps), the forward then running unrecorded."""
    told = run.forward_starting
    if told is not None:
        told(module, inputs)
    return current_run() is run


# the wrappers: each calls torch's function; with a probe open it also times it
def _wrap_root_pre_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def root_pre_forward(self: Any, module: Any, args: Any, kwargs: Any) -> Any:
        run = current_run()
        if run is None:
            return original(self, module, args, kwargs)
        first = self._state_ctx.iter_forward_root is None
        index = _gpu_of(module) if first else None
        ev0 = cuda_event(index)
        t0 = time.perf_counter_ns()
        out = original(self, module, args, kwargs)
        if first and self._state_ctx.iter_forward_root is self and _starts_recorded(run, module, out):
            _open_step(run, module, t0, out[0], out, ev0=ev0)
        return out

    return root_pre_forward


def _wrap_post_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def register_pre_backward_hook(self: Any, output: Any) -> Any:
        probe = _probe()
        if probe is None or self._state_ctx.iter_forward_root is not self:
            return original(self, output)
        if torch.is_grad_enabled():  # before FSDP's own hook, so backward starts before its unshard there
            def on_grad(grad: torch.Tensor) -> None:
                if probe.backward_t0 is None:
                    probe.backward_ev0 = probe.event()
                    probe.backward_t0 = time.perf_counter_ns()

            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(on_grad)
        out = original(self, output)
        probe.forward_done(out)
        return out

    return register_pre_backward_hook


def _wrap_post_backward_callback(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def root_post_backward_final_callback(*args: Any, **kwargs: Any) -> Any:  # FSDP2's (self), FSDP1's (state, module)
        out = original(*args, **kwargs)
        probe = _probe()
        if probe is not None and probe.backward_t0 is not None:
            t0, ev0, probe.backward_t0, probe.backward_ev0 = probe.backward_t0, probe.backward_ev0, None, None
            probe.phase("backward", t0, time.perf_counter_ns(), ev0, probe.event())
            probe.read_allocator("backward")
            probe.memory()
        return out

    return root_post_backward_final_callback


def _wrap_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def foreach_all_gather(fsdp_params: Any, group: Any, async_op: Any, copy_in_stream: Any, stream: Any,
                           device: Any, all_gather_comm: Any) -> Any:
        probe = _probe()
        if probe is None:
            return original(fsdp_params, group, async_op, copy_in_stream, stream, device, all_gather_comm)
        timed = _TimedComm(all_gather_comm, "output_tensor")
        t0 = time.perf_counter_ns()
        result = original(fsdp_params, group, async_op, copy_in_stream, stream, device, timed)
        t1 = time.perf_counter_ns()
        if timed.launch_ns is None or timed.done_ns is None:
            return result
        if isinstance(timed.result, dist.Work):  # asynchronous: done when copy-out's wait returns
            probe.phase("copy_in", t0, timed.launch_ns)
            index = probe.count[ALL_GATHER]
            probe.count[ALL_GATHER] = index + 1
            probe.pending[id(result)] = (index, timed.nbytes, timed.launch_ns)
        else:
            probe.exchange(ALL_GATHER, t0, timed, None)
        if t1 > timed.done_ns:
            probe.step.touch(t1)
        return result

    return foreach_all_gather


def _wrap_copy_out(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def foreach_all_gather_copy_out(all_gather_result: Any, fsdp_params: Any, group: Any) -> Any:
        probe = _probe()
        if probe is None:
            return original(all_gather_result, fsdp_params, group)
        t0 = time.perf_counter_ns()
        pending = probe.pending.pop(id(all_gather_result), None)
        work = getattr(all_gather_result, "all_gather_work", None)
        if pending is not None and isinstance(work, dist.Work):
            work.wait()  # what torch's copy-out waits for first; a second wait returns at once
            t_wait = time.perf_counter_ns()
            probe.phase("all_gather_wait", t0, t_wait)
            index, nbytes, launch = pending
            probe.collective(ALL_GATHER, nbytes, launch, t_wait, index)
            t0 = t_wait
        out = original(all_gather_result, fsdp_params, group)
        probe.phase("copy_out", t0, time.perf_counter_ns())
        return out

    return foreach_all_gather_copy_out


def _wrap_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        probe = _probe()
        if probe is None or len(args) < 5:
            return original(*args, **kwargs)
        timed = _TimedComm(args[4], "input_tensor")
        t0 = time.perf_counter_ns()
        out = original(*args[:4], timed, *args[5:], **kwargs)
        t1 = time.perf_counter_ns()
        if timed.launch_ns is None or timed.done_ns is None:  # one rank: no reduce-scatter ran
            return out
        probe.exchange(REDUCE_SCATTER, t0, timed, t1)
        return out

    return foreach_reduce


def _wrap_wait_for_unshard(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait_for_unshard(self: Any) -> Any:
        probe = _probe()
        if probe is None or self.is_unsharded:
            return original(self)
        out = original(self)
        if self.is_unsharded:
            probe.gathered(_group_unsharded_bytes(self))
        return out

    return wait_for_unshard


def _wrap_reshard(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reshard(self: Any) -> Any:
        probe = _probe()
        if probe is None or not self.is_unsharded:
            return original(self)
        out = original(self)
        if not self.is_unsharded:
            probe.gathered(-_group_unsharded_bytes(self))
        return out

    return reshard


# FSDP1 (FullyShardedDataParallel): the root is the outermost FSDP forward; its own functions are wrapped where
# torch looks them up at each call (the class's forward, the runtime module's hooks, FlatParamHandle's methods).
_fsdp1: dict[str, Any] = {"in_forward": False}


def _fsdp1_shard_bytes(root: torch.nn.Module) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) this rank holds of an FSDP1 model: each flat parameter's local shard less
    its padding."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    params = 0
    for module in FullyShardedDataParallel.fsdp_modules(root):
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        local = getattr(flat, "_local_shard", flat)
        params += (local.numel() - int(getattr(flat, "_shard_numel_padded", 0))) * flat.element_size()
    return params, sum(b.numel() * b.element_size() for b in root.buffers())


def _wrap_fsdp1_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = current_run()
        # not recording; an inner FSDP module inside the root's forward; or one FSDP's lazy init made no root (False,
        # not None before it): a layer called again in backward, recomputed under activation checkpointing
        if run is None or _fsdp1["in_forward"] or getattr(self, "_is_root", None) is False:
            return original(self, *args, **kwargs)
        ev0 = cuda_event(_gpu_of(self))
        if not _starts_recorded(run, self, (args, kwargs)):
            return original(self, *args, **kwargs)
        probe = _open_step(run, self, time.perf_counter_ns(), args, (args, kwargs), _fsdp1_shard_bytes, ev0)
        _fsdp1["in_forward"] = True
        try:
            out = original(self, *args, **kwargs)
        finally:
            _fsdp1["in_forward"] = False
        probe.forward_done(out)
        return out

    return forward


def _wrap_fsdp1_pre_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pre_backward_hook(*args: Any, **kwargs: Any) -> Any:
        probe = _probe()
        if probe is not None and probe.backward_t0 is None:  # the first: before its unshard and prefetch
            probe.backward_ev0 = probe.event()
            probe.backward_t0 = time.perf_counter_ns()
        return original(*args, **kwargs)

    return pre_backward_hook


def _wrap_fsdp1_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def all_gather_flat_param(self: Any, padded_unsharded_flat_param: torch.Tensor) -> Any:
        probe = _probe()
        if probe is None:
            return original(self, padded_unsharded_flat_param)
        t0 = time.perf_counter_ns()
        out = original(self, padded_unsharded_flat_param)
        t1 = time.perf_counter_ns()
        if _fsdp1["in_forward"] or probe.backward_t0 is not None:
            # a part of the step only inside its forward or backward: a full state dict gathered between steps or
            # after the last is a collective of the run, but no part of the step whose probe is still current
            probe.phase("all_gather_wait", t0, t1)
        probe.collective(ALL_GATHER, padded_unsharded_flat_param.numel() * padded_unsharded_flat_param.element_size(),
                         t0, t1)
        if id(self) not in probe.gathered_handles:
            flat = self.flat_param
            nbytes = int(flat._unpadded_unsharded_size.numel()) * flat.element_size()
            probe.gathered_handles[id(self)] = nbytes
            probe.gathered(nbytes)
        return out

    return all_gather_flat_param


def _wrap_fsdp1_free(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def free_unsharded_flat_param(self: Any) -> Any:
        out = original(self)
        probe = _probe()
        if probe is not None and id(self) in probe.gathered_handles:
            probe.gathered(-probe.gathered_handles.pop(id(self)))
        return out

    return free_unsharded_flat_param


class _TimedDist:
    """torch.distributed as FSDP1's runtime module sees it: its reduce-scatter (``reduce_scatter_tensor``, or
    ``reduce_scatter_single`` in newer torch) and its gradient all-reduce (NO_SHARD's, as DDP's) timed inside a
    recording; every other name torch's own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _timed(self, name: str, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        call = getattr(self._inner, name)
        probe = _probe()
        if probe is None or not isinstance(input, torch.Tensor):
            return call(output, input, *args, **kwargs)
        t0 = time.perf_counter_ns()
        out = call(output, input, *args, **kwargs)
        t1 = time.perf_counter_ns()
        probe.phase("reduce_scatter_wait", t0, t1)
        probe.collective(REDUCE_SCATTER, input.numel() * input.element_size(), t0, t1)
        return out

    def reduce_scatter_tensor(self, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        return self._timed("reduce_scatter_tensor", output, input, *args, **kwargs)

    def reduce_scatter_single(self, output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        return self._timed("reduce_scatter_single", output, input, *args, **kwargs)

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """NO_SHARD's gradient all-reduce (one per flat parameter, in its post-backward hook): a DDP run's
        ``comm_wait`` and all-reduce row. Launched asynchronously, it is left to torch untimed."""
        call = self._inner.all_reduce
        probe = _probe()
        if probe is None or not isinstance(tensor, torch.Tensor) or kwargs.get("async_op"):
            return call(tensor, *args, **kwargs)
        t0 = time.perf_counter_ns()
        out = call(tensor, *args, **kwargs)
        t1 = time.perf_counter_ns()
        probe.phase("comm_wait", t0, t1)
        probe.collective(ALL_REDUCE, tensor.numel() * tensor.element_size(), t0, t1)
        return out


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    probe = _probe()
    if probe is not None:
        probe.optimizer_depth += 1
        if probe.optimizer_depth == 1:  # the outermost step: one that steps another inside it is one part
            probe.optimizer_ev0 = probe.event()
            probe.optimizer_t0 = time.perf_counter_ns()


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    probe = _probe()
    if probe is not None and probe.optimizer_t0 is not None:
        probe.optimizer_depth -= 1
        if probe.optimizer_depth > 0:  # an inner optimizer's (ZeroRedundancyOptimizer's local one)
            return
        probe.phase("optimizer", probe.optimizer_t0, time.perf_counter_ns(), probe.optimizer_ev0, probe.event())
        probe.optimizer_t0 = probe.optimizer_ev0 = None


_MODULES = ("dist", "warnings")  # the module globals wrapped (torch.distributed, warnings), not functions


def installed() -> bool:
    """Whether FSDP's functions are wrapped now."""
    return bool(_patches)


def _fsdp2_targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    from torch.distributed.fsdp._fully_shard import _fsdp_state as state_module

    state_cls, group_cls = state_module.FSDPState, group_module.FSDPParamGroup
    # the module's warnings (a torch whose post-forward warns: 2.13's of a view tensor) name torch's lines, not dpprof's
    warns = [(state_module, "warnings", WarningsPastDpprof)] if "warnings" in vars(state_module) else []
    return warns + [(state_cls, "_root_pre_forward", _wrap_root_pre_forward),
            (state_cls, "_register_pre_backward_hook", _wrap_post_forward),
            (state_cls, "_root_post_backward_final_callback", _wrap_post_backward_callback),
            (group_cls, "wait_for_unshard", _wrap_wait_for_unshard),
            (group_cls, "reshard", _wrap_reshard),
            (group_module, "foreach_all_gather", _wrap_all_gather),
            (group_module, "foreach_all_gather_copy_out", _wrap_copy_out),
            (group_module, "foreach_reduce", _wrap_reduce)]


def _fsdp1_targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    from torch.distributed.fsdp import _flat_param, _runtime_utils
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    handle = _flat_param.FlatParamHandle
    return [(FullyShardedDataParallel, "forward", _wrap_fsdp1_forward),
            (_runtime_utils, "_pre_backward_hook", _wrap_fsdp1_pre_backward),
            (_runtime_utils, "_post_backward_final_callback", _wrap_post_backward_callback),
            (handle, "_all_gather_flat_param", _wrap_fsdp1_all_gather),
            (handle, "_free_unsharded_flat_param", _wrap_fsdp1_free),
            (_runtime_utils, "dist", lambda inner: _TimedDist(inner))]


def install() -> bool:
    """Wrap FSDP2's and FSDP1's per-step functions so that steps inside a recording are recorded (idempotent).
    Each API is wrapped whole or not at all.

    Returns:
        whether any is wrapped: False where this torch has neither or its functions are not the ones this module
        knows (then nothing is wrapped, and FSDP runs unrecorded).
    """
    with _lock:
        if _patches:
            return True
        for targets_of in (_fsdp2_targets, _fsdp1_targets):
            try:
                targets = targets_of()
            except (ImportError, AttributeError):  # a torch built without torch.distributed, or one whose FSDP moved
                continue
            found = [(owner.__dict__ if isinstance(owner, type) else vars(owner)).get(name)
                     for owner, name, _ in targets]
            if any(f is None or (name not in _MODULES and not callable(f)) for f, (_, name, _) in zip(found, targets)):
                continue
            for (owner, name, wrap), original in zip(targets, found):
                _patches.append((owner, name, original))
                setattr(owner, name, wrap(original))
        if not _patches:
            return False
        _state["hooks"] = [register_optimizer_step_pre_hook(_optimizer_pre),
                           register_optimizer_step_post_hook(_optimizer_post)]
        return True


def uninstall() -> None:
    """Put torch's own FSDP functions back."""
    with _lock:
        for owner, name, original in reversed(_patches):
            setattr(owner, name, original)
        _patches.clear()
        for hook in _state["hooks"]:
            hook.remove()
        _state.update(probe=None, previous=None, hooks=[])
        _fsdp1["in_forward"] = False
