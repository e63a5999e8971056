"""dpprof.DistributedDataParallel: torch's DDP, each rank's step recorded phase by phase.

Per rank and step: the gap since the previous step ended (data loading; an implicit step starts there, so it is
inside the step), forward, backward, each gradient
bucket's all-reduce (through a communication hook that wraps the default all-reduce or the
user's own hook, timing launch and completion), the time backward waits for the last
all-reduce, and the optimizer step. The rank is the device axis ("rank:N"). A rank whose module
is on a GPU also records its process's caching-allocator counters at the end of forward and of
backward, the peak counted from the step's start, and each part's time on the GPU from CUDA events
recorded on the current stream at the part's ends (``device_duration_ms``, read once the events
complete; the step never waits for them). The host's parts and the GPU's differ where the host waits:
the data part's GPU time runs from the previous step's last work on the GPU to forward's first, so a
host that waits in a blocking copy for the GPU to finish the previous step shows a long host data part
and a short GPU one.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import distributed as _torch_ddp
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dpprof.loaders import take as loader_calls
from dpprof.device_ids import rank_devices
from dpprof.parallel import script_comms
from dpprof.parallel.callers import WarningsPastDpprof
from dpprof.parallel.probe import (ForwardProbe, allocator_bytes, cuda_event, end_after_error, gpu_of, iter_tensors,
                                   on_gradient, rank_part)
from dpprof.recording import RELEASE_HOOKS, Run, current_run
from dpprof.records import ALL_REDUCE, ALL_REDUCE_RANGE, COMM_ROW, AllocatorRecord

__all__ = ["DistributedDataParallel"]

# The probe of the latest recorded DDP forward in this process, for the optimizer hooks.
_latest: dict[str, Any] = {"probe": None}
_optimizer_hooks: list[Any] = []
# The DDP models recorded in this process, in the order their first bucket was reduced: a later model's buckets are
# numbered after the earlier ones' (_bucket_id), so a GAN's or an encoder-decoder's two models are two sets of buckets
_recorded_models: list[weakref.ref[DistributedDataParallel]] = []
_hooks_lock = threading.Lock()


def _release(run: Run) -> None:
    """The run closed: the latest forward's probe (which holds the model inside DDP) is let go."""
    if _latest["probe"] is not None and _latest["probe"].run is run:
        _latest["probe"] = None


RELEASE_HOOKS.append(_release)


def _install_optimizer_hooks() -> None:
    """Time every optimizer step that follows a recorded DDP forward (global hooks, installed once)."""
    with _hooks_lock:
        if _optimizer_hooks:
            return

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            probe = _latest["probe"]
            if probe is not None:
                probe.optimizer_depth += 1
                if probe.optimizer_depth == 1:  # the outermost step: one that steps another inside it is one part
                    probe.optimizer_ev0 = probe.event()
                    probe.optimizer_t0 = time.perf_counter_ns()

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            probe = _latest["probe"]
            if probe is not None and probe.optimizer_t0 is not None:
                probe.optimizer_depth -= 1
                if probe.optimizer_depth > 0:  # an inner optimizer's (ZeroRedundancyOptimizer's local one)
                    return
                t1 = time.perf_counter_ns()
                probe.phase_done("optimizer", probe.optimizer_t0, t1, probe.optimizer_ev0, probe.event())
                probe.optimizer_t0 = probe.optimizer_ev0 = None

        _optimizer_hooks.append(register_optimizer_step_pre_hook(pre))
        _optimizer_hooks.append(register_optimizer_step_post_hook(post))


class _RankProbe:
    """One recorded DDP step on one rank."""

    def __init__(self, run: Run, rank: int, previous: _RankProbe | None, cuda_index: int | None = None,
                 module: torch.nn.Module | None = None) -> None:
        self.run = run
        self.devices = rank_devices(rank)
        self.label = self.devices.label(rank)
        # the module called: the step rule tells models apart by it (a distillation's teacher, then a DDP student)
        self.forward = ForwardProbe(run, self.devices, self.label, dim=0, root=module)
        self.step = self.forward.step
        self.cuda_index = cuda_index  # the GPU this rank's module is on (None: on the CPU)
        if cuda_index is not None and self.forward.call == 0:
            torch.cuda.reset_peak_memory_stats(cuda_index)  # the step's peak, as DataParallel records it
        self.previous_end_ns = previous.last_end_ns if previous is not None else None
        self.last_end_ns: int = time.perf_counter_ns()
        # on a GPU: the CUDA event at the end of the previous step's last part (the GPU's start of this step's data)
        self.previous_end_event = previous.last_end_event if previous is not None else None
        self.last_end_event: torch.cuda.Event | None = None
        self.optimizer_t0: int | None = None
        self.optimizer_ev0: torch.cuda.Event | None = None
        # optimizer steps begun and not ended: an optimizer that steps another inside its own step (ZeroRedundancy-
        # Optimizer's local optimizer, a Lookahead wrapper) is timed from the outer step's start to its end
        self.optimizer_depth = 0
        self.backward_t0: int | None = None
        self.backward_ev0: torch.cuda.Event | None = None
        self.graph_end_ns: int | None = None
        self.launches: list[int] = []
        self.last_launch_event: torch.cuda.Event | None = None
        self.completions: list[int] = []
        self.split_backward = True  # False under torch's built-in (C++) hook: no all-reduce is seen, none waited for
        self.lock = threading.Lock()

    def event(self) -> torch.cuda.Event | None:
        """A CUDA timing event recorded now on this rank's GPU's current stream (None for a rank on the CPU)."""
        return cuda_event(self.cuda_index)

    def phase_done(self, name: str, t0: int, t1: int, ev0: torch.cuda.Event | None = None,
                   ev1: torch.cuda.Event | None = None) -> None:
        """A part from host time t0 to t1; with its CUDA events (a rank on a GPU), its GPU time too (``rank_part``)."""
        rank_part(self.run, self.step.index, name, self.label, t0, t1, self.cuda_index, ev0, ev1)
        self.step.touch(t1)
        with self.lock:
            if t1 >= self.last_end_ns:  # the newest part's end, and its event where it has one
                self.last_end_ns, self.last_end_event = t1, ev1

    def read_allocator(self, phase: str) -> None:
        """The caching allocator's allocated, peak and reserved bytes on this rank's GPU, now."""
        if self.cuda_index is not None:
            allocated, peak, reserved = allocator_bytes(self.cuda_index)
            self.run.emit(AllocatorRecord(self.step.index, 0, self.label, phase, allocated, peak, reserved))

    def launched(self, launch_ns: int) -> None:
        event = self.event()  # the GPU's view of the launch: backward's compute queued before it is done there
        with self.lock:
            self.launches.append(launch_ns)
            if self.launches[-1] == max(self.launches):
                self.last_launch_event = event

    def comm(self, bucket: int, nbytes: int, launch_ns: int, done_ns: int) -> None:
        # a row (dpprof.records.Row): COMM_ROW, then CommRecord's step, device, bucket, bucket_bytes, launch_ms,
        # duration_ms, collective
        self.run.emit((COMM_ROW, self.step.index, self.label, bucket, nbytes, self.run.ms(launch_ns),
                       (done_ns - launch_ns) / 1e6, ALL_REDUCE))
        with self.lock:
            self.completions.append(done_ns)
        self._maybe_finish_backward()

    def backward_done(self, t_end: int) -> None:
        self.step.passes += 1  # the next forward in this step is a later micro-batch (ForwardProbe.later_pass)
        with self.lock:
            self.graph_end_ns = t_end
        self._maybe_finish_backward()

    def backward_started(self) -> None:
        """The first gradient reached the output: backward's start (once a step). A backward run after its forward's
        step ended (a GAN's generator, backpropagated through the discriminator in its own step) is the open step's,
        its all-reduces too."""
        if self.backward_t0 is None:
            if self.step.closed:
                self.step = self.run.open_step() or self.step
            self.backward_ev0 = self.event()
            self.backward_t0 = time.perf_counter_ns()
            torch.autograd.Variable._execution_engine.queue_callback(self._after_the_reducer)

    def _after_the_reducer(self) -> None:
        """The first of backward's final callbacks: DDP's reducer queued its own during the graph, after this one (it
        waits for every bucket's all-reduce, then copies the reduced gradients into ``.grad``), so backward's end is
        taken in a callback queued from here, which the autograd engine runs after it."""
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.backward_done(time.perf_counter_ns()))

    def _maybe_finish_backward(self) -> None:
        """Once the graph task has ended and every launched all-reduce completed (in either order),
        split backward into compute and the wait for the last all-reduce."""
        with self.lock:
            t0, t_end = self.backward_t0, self.graph_end_ns
            if t0 is None or t_end is None or len(self.completions) < len(self.launches):
                return
            last_launch = max(self.launches, default=t_end)
            end = max(t_end, max(self.completions, default=t_end))
            ev0, launch_event = self.backward_ev0, self.last_launch_event
            self.backward_t0 = self.graph_end_ns = self.backward_ev0 = self.last_launch_event = None
            self.launches, self.completions = [], []
        ev_end = self.event()
        if not self.split_backward:  # its wait for the all-reduces is in it, unseen: backward whole, no compute of it
            self.phase_done("backward", t0, end, ev0, ev_end)
            self.read_allocator("backward")
            return
        if launch_event is None:  # no all-reduce launched: backward's compute ends with it
            launch_event = ev_end
        self.phase_done("backward", t0, end, ev0, ev_end)
        self.phase_done("backward_compute", t0, last_launch, ev0, launch_event)
        self.phase_done("comm_wait", last_launch, end, launch_event, ev_end)
        self.read_allocator("backward")


class _Sent:
    """The bytes one bucket's hook sends: the tensors of the collectives it launches through torch.distributed."""

    __slots__ = ("nbytes", "seen")

    def __init__(self) -> None:
        self.nbytes = 0
        self.seen = False  # a collective was counted (else the bucket's size stands for it)


# What a communication hook sent, not its bucket's size: a compressing hook (fp16/bf16 compress) all-reduces a copy of
# half the bytes, PowerSGD its low-rank factors. Each bucket's hook runs with its _Sent as this thread's
# _sending.sent, and torch.distributed's all_reduce and all_gather add their tensor's bytes to it. A hook's later
# collectives, launched from its future's callbacks on a communication thread (gloo's: PowerSGD's P and Q), count into
# the oldest bucket still in flight: a rank's total is exact, the split between buckets in flight together is not.
_sending = threading.local()
_in_flight: list[_Sent] = []
_hook_threads: set[int] = set()  # threads that ran a bucket's hook (backward's): their own collectives (SyncBatchNorm's
# backward) are no bucket's
_sent_lock = threading.Lock()


def _counting(collective: Callable[..., Any], position: int, name: str) -> Callable[..., Any]:
    """torch.distributed's ``collective``, adding the bytes of its tensor argument (at ``position``, or keyword ``name``)
    to the bucket whose hook launched it."""

    @functools.wraps(collective)
    def counted(*args: Any, **kwargs: Any) -> Any:
        sent: _Sent | None = getattr(_sending, "sent", None)
        if sent is None and _in_flight and threading.get_ident() not in _hook_threads:
            with _sent_lock:
                sent = _in_flight[0] if _in_flight else None
        if sent is not None:
            tensor = args[position] if len(args) > position else kwargs.get(name)
            if isinstance(tensor, torch.Tensor):
                sent.nbytes += tensor.numel() * tensor.element_size()
                sent.seen = True
        return collective(*args, **kwargs)

    counted._dpprof_counting = True  # type: ignore[attr-defined]
    script_comms.skip_wrapper(counted.__code__)  # type: ignore[attr-defined] # the script's call of a collective it counts is the script's
    return counted


def _count_sent() -> None:
    """Count what hooks send through torch.distributed's all_reduce and all_gather (installed once a process)."""
    with _sent_lock:
        for name, position, keyword in (("all_reduce", 0, "tensor"), ("all_gather", 1, "tensor")):
            collective = getattr(dist, name)
            if not getattr(collective, "_dpprof_counting", False):
                setattr(dist, name, _counting(collective, position, keyword))


def _bucket_id(owner: DistributedDataParallel, index: int, run: Run) -> int:
    """A bucket's number in the run's comms: its index in ``owner``'s reducer after the buckets of the DDP models
    recorded in ``run`` before it (each model's reducer numbers its own from 0), in the order their first buckets
    were reduced. A model's span is the most buckets it has reduced: a backward through both models at once in the
    first step (before an earlier model's last bucket), or DDP's rebuilding of buckets after it, may number the
    first step's alike (no figure counts the first step's buckets)."""
    state = owner.__dict__
    if "_dpprof_span" not in state:
        with _hooks_lock:
            _recorded_models[:] = [ref for ref in _recorded_models if ref() is not None]
            _recorded_models.append(weakref.ref(owner))
    if index >= state.get("_dpprof_span", 0):
        state["_dpprof_span"] = index + 1
    offset = 0
    for ref in _recorded_models:
        model = ref()
        if model is owner:
            break
        probe = model.__dict__["_dpprof_probe"] if model is not None else None
        if probe is not None and probe.run is run:
            offset += model.__dict__.get("_dpprof_span", 0)
    return offset + index


def _timed_hook(owner: DistributedDataParallel, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a DDP communication hook so each bucket's launch and completion, and the bytes it sent, are recorded.
    The hook reaches ``owner`` by a weak reference: torch's reducer holds the hook where Python's collector cannot see
    it, so a strong one would keep the model (and its process group) alive after the script dropped it, to be freed
    only when the interpreter ends, when gloo may abort the process."""
    _count_sent()
    owner_ref = weakref.ref(owner)

    def dpprof_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        owner = owner_ref()
        probe: _RankProbe | None = owner.__dict__["_dpprof_probe"] if owner is not None else None
        # not recording; or a step ended (Join's shadow all-reduces of a rank out of inputs, after its last step): no
        # step's
        if owner is None or probe is None or probe.step.closed:
            return inner(state, bucket)
        launch = time.perf_counter_ns()
        probe.launched(launch)
        index = _bucket_id(owner, bucket.index(), probe.run)
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
        sent = _Sent()
        with _sent_lock:
            _in_flight.append(sent)
            _hook_threads.add(threading.get_ident())
        _sending.sent = sent
        try:
            with record_function(ALL_REDUCE_RANGE):
                fut = inner(state, bucket)
        finally:
            _sending.sent = None

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            with _sent_lock:
                if sent in _in_flight:
                    _in_flight.remove(sent)
            # a hook whose collectives dpprof did not see (launched other than through torch.distributed's
            # functions): its bucket's size
            probe.comm(index, sent.nbytes if sent.seen else nbytes, launch, time.perf_counter_ns())
            return f.value()

        return fut.then(done)

    dpprof_comm_hook.__qualname__ = f"dpprof_comm_hook({getattr(inner, '__qualname__', 'hook')})"
    dpprof_comm_hook._dpprof_inner = inner  # type: ignore[attr-defined]  # what a pickled DDP keeps
    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563)
    dpprof_comm_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}
    return dpprof_comm_hook


_DEFAULT = "default"  # _dpprof_hooked: dpprof registered torch's default all-reduce itself (the script no hook yet)


def _default_hook(owner: DistributedDataParallel) -> Callable[[Any, Any], Any]:
    """The hook dpprof registers (timed) where the script has none yet: torch's default all-reduce, until the script
    registers a hook of its own (``_dpprof_chosen``), which then runs in its place: torch's reducer takes one hook.
    ``owner`` is reached by a weak reference, as in `_timed_hook`."""
    owner_ref = weakref.ref(owner)

    def chosen(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        owner = owner_ref()
        chosen_hook = owner.__dict__.get("_dpprof_chosen") if owner is not None else None
        hook_state, hook = chosen_hook or (state, allreduce_hook)
        run_hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]] = hook
        return run_hook(hook_state, bucket)

    chosen.__qualname__ = allreduce_hook.__qualname__
    timed = _timed_hook(owner, chosen)
    timed._dpprof_inner = allreduce_hook  # type: ignore[attr-defined]  # a pickled DDP drops it, as torch's default
    timed._dpprof_default = True  # type: ignore[attr-defined]
    return timed


# torch's DDP constructors running inside _warnings_at_caller, in every thread: its module's warnings stay dpprof's
# while any runs, torch's own once none does
_constructing: dict[str, Any] = {"count": 0, "inner": None}
_constructing_lock = threading.Lock()


@contextmanager
def _warnings_at_caller() -> Iterator[None]:
    """Around torch's DDP constructor: a warning it gives at its caller's line (``stacklevel=2``, as its
    ``broadcast_buffers`` deprecation) is given at the line that built the model, as under torch, not at dpprof's
    constructor (or the stand-in's) that calls torch's; others as they were, each under the script's filters."""
    module = vars(_torch_ddp)
    if "warnings" not in module:  # a torch whose DDP gives no warning of its own
        yield
        return
    with _constructing_lock:
        if not _constructing["count"]:
            _constructing["inner"] = module["warnings"]
            module["warnings"] = WarningsPastDpprof(_constructing["inner"])
        _constructing["count"] += 1
    try:
        yield
    finally:
        with _constructing_lock:
            _constructing["count"] -= 1
            if not _constructing["count"]:
                module["warnings"] = _constructing["inner"]


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch.nn.parallel.DistributedDataParallel (same constructor, same behaviour), recorded per rank.

    Inside ``dpprof.record`` each forward starts a step (or joins the open ``run.step()``); its
    backward's gradient buckets are timed through a communication hook around the default
    all-reduce, or around the hook you register with ``register_comm_hook``.

    Example:
        >>> ddp = dpprof.DistributedDataParallel(model)           # after dist.init_process_group
        >>> with dpprof.record(name="ddp") as run:                # on every rank
        ...     for x, y in loader:
        ...         loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # before torch's constructor, which registers a hook itself for its mixed_precision or optimizers in backward
        self.__dict__["_dpprof_hooked"] = False
        self.__dict__["_dpprof_probe"] = None
        with _warnings_at_caller():
            super().__init__(*args, **kwargs)
        self.__dict__["_dpprof_cuda"] = gpu_of(self.module)
        self.__dict__["_dpprof_previous"] = None

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register ``hook`` as torch does; dpprof times each bucket's all-reduce around it. After a recorded forward
        made dpprof register the default all-reduce (the hook's one place in torch's reducer), ``hook`` takes its
        place there, as torch's first registration would."""
        self._check_comm_hook(hook)
        self.__dict__["_dpprof_hook_name"] = getattr(hook, "__qualname__", None) or repr(hook)
        if self.__dict__["_dpprof_hooked"] == _DEFAULT:
            self.__dict__["_dpprof_hooked"] = True
            self.__dict__["_dpprof_chosen"] = (state, hook)
            if self.logger is not None:  # what torch's register_comm_hook does, but registering
                self.logger._set_comm_hook_name(hook.__qualname__)
            self._comm_hooks[:] = [(_timed_hook(self, hook), state) if getattr(h, "_dpprof_default", False)
                                   else (h, s) for h, s in self._comm_hooks]
            return
        self.__dict__["_dpprof_hooked"] = True
        super().register_comm_hook(state, _timed_hook(self, hook))

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's C++ hook (``dist.BuiltinCommHookType``), which dpprof cannot wrap: registered as torch does, its
        buckets untimed (the run says so). After dpprof registered the default all-reduce, torch's error for a second
        hook."""
        if self.__dict__["_dpprof_hooked"] == _DEFAULT:
            raise RuntimeError(f"dpprof cannot register the built-in communication hook {comm_hook_type} after a "
                               "recorded forward: register it before the first forward (or use register_comm_hook "
                               "with torch.distributed.algorithms.ddp_comm_hooks.default_hooks)")
        self.__dict__["_dpprof_hooked"] = True
        self.__dict__["_dpprof_builtin"] = self.__dict__["_dpprof_hook_name"] = str(comm_hook_type)
        super()._register_builtin_comm_hook(comm_hook_type)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        run = current_run()
        if run is None:
            self.__dict__["_dpprof_probe"] = None  # a backward after the run must not record into it
            _latest["probe"] = None
            return super().forward(*inputs, **kwargs)
        if not self.__dict__["_dpprof_hooked"]:  # torch's default all-reduce, timed, until the script registers a hook
            super().register_comm_hook(self.process_group, _default_hook(self))
            self.__dict__["_dpprof_hooked"] = _DEFAULT
        _install_optimizer_hooks()
        if not run.records_comms:
            script_comms.install(run)
            run.records_comms = True
        previous: _RankProbe | None = self.__dict__["_dpprof_previous"]
        if previous is not None and previous.run is not run:
            previous = None
        probe = _RankProbe(run, dist.get_rank(self.process_group) if dist.is_initialized() else 0, previous,
                           self.__dict__.get("_dpprof_cuda"), self._modules["module"])
        self.__dict__["_dpprof_probe"] = probe
        self.__dict__["_dpprof_previous"] = probe
        _latest["probe"] = probe
        hook_name = self.__dict__.get("_dpprof_hook_name")
        if hook_name is not None:  # the script's hook, stored with the run: the findings' advice names it
            run.note_workload(comm_hook=hook_name)
        builtin = self.__dict__.get("_dpprof_builtin")
        if builtin is not None:
            run.note("dpprof", f"a DistributedDataParallel's built-in communication hook ({builtin}) runs in C++, "
                     "where dpprof cannot time it: its gradient all-reduces are not recorded and its backward is not "
                     "split into compute and the wait for them", tell=False)
            probe.split_backward = False
        ev0 = probe.event()
        t0 = time.perf_counter_ns()
        if probe.previous_end_ns is not None:
            # data is inside its step (dpprof.stepmodel): an implicit step this forward starts begins where the
            # previous one ended; an explicit run.step() keeps its start, and data before it is not this step's
            step, data_start = probe.step, probe.previous_end_ns
            if run.last_step_end_ns is not None:  # never inside the step before (a GAN's generator ended in it)
                data_start = max(data_start, run.last_step_end_ns)
            data_start = max(data_start, run.capture_turned_ns)  # nor over a deep capture's start or stop
            if probe.forward.call > 0:  # a later forward of the step (a second DDP model's: an encoder's, then its
                # decoder's): never over the parts recorded in it before (the first model's forward read as data)
                data_start = max(data_start, probe.step.last_end_ns)
            if not step.explicit and probe.forward.call == 0:
                step.start_ns = min(step.start_ns, data_start)
                step.loader_ms = None  # the DataLoader's time since the step before is its data part, in the step
            data_start = max(data_start, step.start_ns)
            # the script's collectives since the last step are this step's (held since then), and no part of its data
            held = script_comms.settle(run, step, step.start_ns) if probe.forward.call == 0 else []
            pieces = script_comms.data_pieces(data_start, t0, held, loader_calls(data_start, t0))
            if pieces is not None:  # the DataLoader's calls, around the script's collectives: host time alone
                for a, b in pieces:
                    probe.phase_done("data", a, b)
            elif t0 > data_start:
                # on a GPU, the data part's GPU time only where it starts at the previous step's end (not at an
                # explicit step's start, which no event marks)
                data_ev0 = probe.previous_end_event if data_start == probe.previous_end_ns else None
                probe.phase_done("data", data_start, t0, data_ev0, ev0)
        elif probe.forward.call == 0:  # the first step: what the script called before it is in no step
            script_comms.settle(run, probe.step, probe.step.start_ns)
        probe.forward.note_batch(inputs, kwargs)
        with record_function("dpprof.forward"):
            try:
                # calls alike (this module, its input shapes) counted from the graph once, then every so many calls
                output, activation_bytes = probe.forward.call_counting_activations(
                    super().forward, self.module, inputs, kwargs, site=(probe.label, "forward", id(self.module)))
            except BaseException:
                # the script may catch it and go on (every rank skipping the batch): the part, and the call counted in
                # its step's raised_calls, as DataParallel's
                probe.phase_done("forward", t0, time.perf_counter_ns(), ev0, probe.event())
                end_after_error(probe.forward, self.module, used=1)
                raise
        probe.phase_done("forward", t0, time.perf_counter_ns(), ev0, probe.event())
        probe.read_allocator("forward")
        probe.forward.note_device(probe.label, inputs, kwargs, output, activation_bytes)
        probe.forward.end(self.module, used=1)
        self._watch_backward(probe, output)
        return output

    @staticmethod
    def _watch_backward(probe: _RankProbe, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in iter_tensors(output) if t.requires_grad]

        def on_grad(grad: Any) -> None:
            probe.backward_started()

        for t in tensors:
            on_gradient(t, on_grad)
