"""Recording sessions: ``with dpprof.record(...) as run`` and ``with run.step():``.

A Run owns the clock, the step counter and a sink that receives records. Every
dpprof DataParallel called while a run is active records into the innermost one.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from datetime import datetime, timezone
from typing import Any, Callable, Protocol

import pandas as pd
import torch

from dpprof.capture.session import NO_CAPTURE, CaptureSession
from dpprof.capture.window import CaptureWindow, parse_capture
from dpprof.device_ids import DeviceSet
from dpprof.devices import inventory, nvml_handles
from dpprof.loaders import MAX_LOADERS, claim, receive, time_in
from dpprof.nvml import DEFAULT_SAMPLE_HZ, GpuSampler, Nvml, NvmlUnavailable
from dpprof.records import CHECK_OF_ENV, STEP_ROW, TABLE_OF, NoteRecord, Record, Row, record_of_row
from dpprof.signals import Interrupted, SignalGuard, signal_name
from dpprof.store.faults import start_failure
from dpprof.store.ids import new_run_id
from dpprof.store.reader import RUN_SUFFIX, load_run, typed
from dpprof.store.reader import reports_dir as resolve_reports_dir
from dpprof.units import plural
from dpprof.store.retention import Retention, retention_of
from dpprof.store.staging import open_sink
from dpprof.store.writer import fold_leftover_logs

__all__ = ["Run", "record", "current_run", "MemorySink", "Sink", "CLOSE_HOOKS"]

log = logging.getLogger("dpprof")


def _store_findings(run: Run) -> None:
    """Close hook: store the run's findings in its file (dpprof.report.store_findings)."""
    from dpprof.report import store_findings  # here, not at the top: recording never loads analysis to record

    store_findings(run)


# Called with each stored run after it closes; every stored run gets its findings.
CLOSE_HOOKS: list[Callable[[Run], None]] = [_store_findings]
# Called with every run as it closes, stored or not: the recorders of dpprof.parallel drop the step probes they keep
# between a run's calls (each holds its model), so a model the script drops after its run is freed then, not kept
# to the interpreter's end (where gloo's process group, freed last, aborts a rank now and then)
RELEASE_HOOKS: list[Callable[[Run], None]] = []

_active: list[Run] = []
_active_lock = threading.Lock()
_start_lock = threading.Lock()  # held while a record() checks the other threads' runs and starts its own


def current_run() -> Run | None:
    """The innermost active run, or None when nothing is recording."""
    return _active[-1] if _active else None


def _note_data_loader(found: dict[str, Any]) -> bool:
    """A DataLoader is iterated (dpprof.loaders.install_watch): the recording run keeps its settings (``found``:
    dpprof.loaders.describe); False where no run records (the watch keeps them for the next)."""
    run = current_run()
    if run is None:
        return False
    run.note_data_loader(found)
    return True


receive(_note_data_loader)


_optimizer_hook: list[Any] = []  # the global optimizer step hook below, once registered (one per process)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Torch's global optimizer step post hook: the innermost run's open implicit step holds the optimizer steps that
    follow its backward (Run.optimizer_stepped)."""
    if _active:
        _active[-1].optimizer_stepped(optimizer)


def _install_optimizer_hook() -> None:
    with _active_lock:
        if not _optimizer_hook:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _optimizer_hook.append(register_optimizer_step_post_hook(_optimizer_stepped))


class Sink(Protocol):
    def put(self, record: Record | Row) -> None: ...  # a record, or a row of one (dpprof.records.Row)
    def update_run(self, **values: Any) -> None: ...
    def close(self, steps_total: int | None = None) -> None: ...


class MemorySink:
    """Keeps records in lists, one per table (for runs that are not to be stored)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[Record]] = {name: [] for name in TABLE_OF.values()}

    def put(self, record: Record | Row) -> None:
        if isinstance(record, tuple):  # a row (dpprof.records.Row): (table, *fields)
            self.tables[record[0]].append(record_of_row(record))  # list.append is atomic under the GIL
        else:
            self.tables[TABLE_OF[type(record)]].append(record)

    def update_run(self, **values: Any) -> None:
        pass

    def close(self, steps_total: int | None = None) -> None:
        pass


def _distributed_identity(name: str | None, run_id: str | None = None
                          ) -> tuple[str | None, str | None, int | None, int | None]:
    """Under torch.distributed with several ranks, rank 0's run id (``run_id`` where rank 0 was given one) and
    name for every rank (a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return run_id, name, None, None
    shared = [run_id or new_run_id(), name] if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0], shared[1], dist.get_rank(), dist.get_world_size()


class _Step:
    __slots__ = ("index", "start_ns", "explicit", "calls", "batch_size", "batch_of", "batch_inputs", "devices_used",
                 "last_end_ns", "grad", "opened_by", "passes", "weighed", "closed", "stepped", "raised_calls",
                 "loader_ms", "on_close")

    def __init__(self, index: int, start_ns: int, explicit: bool) -> None:
        self.index = index
        self.start_ns = start_ns
        self.explicit = explicit
        self.grad = True  # an implicit step under a step rule: whether its first forward ran with grad enabled
        self.opened_by: int | None = None  # ... and the module of that forward (id), where the caller said it
        # backward passes ended in the step (several: gradient accumulation); an FSDP rank's counts one once its memory
        # for the step is written (dpprof.parallel.fsdp: at the first backward's end, or a no_grad forward's)
        self.passes = 0
        self.weighed: tuple[int, ...] | None = None  # the modules whose weights the step's memory counts (ids)
        # ended: its step record is made, or an optimizer step ended it (its record held: Run.end_step); what a stale
        # probe does after it belongs to no step
        self.closed = False
        # an optimizer stepped after its backward: what the script does next (its own collectives) is between steps
        self.stepped = False
        self.calls = 0
        self.raised_calls = 0  # forward calls that raised (dpprof.parallel.probe.end_after_error)
        # the DataLoader's time between the step before and this one (StepRecord.loader_ms; Run._new_step)
        self.loader_ms: float | None = None
        # called as the step's record is made, before it: an FSDP root's forward that never ended raised, and is counted
        # there where no later root forward counted it (dpprof.parallel.fsdp: the script's last, or a run.step() block's)
        self.on_close: Callable[[], None] | None = None
        self.batch_size: int | None = None
        # the module whose calls the batch counts (id; 0 for a DDP rank's): the step's first, so that a step of two
        # models (a GAN's generator and discriminator) counts its samples once, and micro-batches of one model add up
        self.batch_of: int | None = None
        # the first input tensor of each call the batch counted, with its version: a call on the same tensor, unchanged
        # (an LBFGS closure's or SAM's second pass over the step's batch), takes no new samples
        self.batch_inputs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.devices_used = 0
        self.last_end_ns = start_ns

    def add_batch(self, module: int, first: torch.Tensor, samples: int) -> None:
        """Add a call's ``samples`` to the step's batch where the call is of the step's first ``module`` (its id) and
        ``first``, its first input tensor, is not one an earlier call of the step took unchanged: micro-batches of
        gradient accumulation add up, a second model's calls (a GAN's) and passes again over the same batch (an LBFGS
        closure's evaluations, SAM's two passes) do not."""
        if self.batch_of is None:
            self.batch_of = module
        if self.batch_of != module:
            return
        try:
            version = first._version
        except RuntimeError:  # an inference tensor (made under torch.inference_mode) keeps no version: counted
            self.batch_size = (self.batch_size or 0) + samples
            return
        for ref, seen in self.batch_inputs:  # a loop, not any() over a generator: one call a step, most steps
            if ref() is first and seen == version:
                return
        try:
            self.batch_inputs.append((weakref.ref(first), version))
        except TypeError:  # no weak reference: counted, as before
            pass
        self.batch_size = (self.batch_size or 0) + samples

    def touch(self, end_ns: int) -> None:
        if end_ns > self.last_end_ns:
            self.last_end_ns = end_ns


class _StepBlock:
    """The context manager run.step() returns (a class rather than a generator: it runs every step).

    It does no more than an implicit step does at a forward call: one lock to open the step, one
    clock reading and one record to close it."""

    __slots__ = ("run", "step")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.step: _Step | None = None

    def __enter__(self) -> int:
        run = self.run
        with run._lock:
            if run._explicit is not None:
                raise RuntimeError("run.step() blocks cannot be nested")
            if run._implicit is not None:  # forward calls before the block, in a step of their own
                run._flush_implicit()
            step = self.step = run._explicit = run._new_step(explicit=True)
        return step.index

    def __exit__(self, *exc: object) -> None:
        end_ns = time.perf_counter_ns()
        run = self.run
        # one store, no lock: every reader of _explicit (step_for_forward, forward_starts_step) reads it once
        run._explicit = None
        assert self.step is not None, "run.step() left before it was entered"
        run._close_step(self.step, end_ns)


class Run:
    """One recording: metadata, a clock, steps, and the sink its records go to."""

    def __init__(self, name: str | None = None, reports_dir: str | os.PathLike[str] | None = None,
                 sync_timing: bool = False, workload: str | None = None,
                 workload_args: dict[str, Any] | None = None, store: bool = True,
                 sample_hz: float | None = DEFAULT_SAMPLE_HZ, run_id: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 detail: str | Retention = "bounded", capture: str | CaptureWindow | None = None) -> None:
        window = parse_capture(capture)  # a bad window: one line, before any file is made
        now = datetime.now(timezone.utc)
        # the ms clock starts with created_at (not after the run file is opened, which can take tens of ms): so
        # created_at + start_ms is when a record happened, and the ranks of a distributed run line up on it
        self._t0_ns = time.perf_counter_ns()
        self.retention = retention_of(detail)
        self.id = run_id or new_run_id(now)
        self.thread_id = threading.get_ident()  # the thread whose record() made it: its calls are the run's
        self.rank, self.world_size = rank, world_size
        self.name = name or self.id
        self.workload = workload
        self.workload_args = dict(workload_args or {})
        # the intra-op threads the caller and its CPU workers share, for every recording (dpprof advise models them)
        self.workload_args.setdefault("threads", torch.get_num_threads())
        # the DataLoader watch (on from import dpprof: dpprof.loaders.watch) is on from the start: [] says none was
        # iterated, where a file without the key (written before) says nothing (dpprof.loaders)
        self.workload_args.setdefault("data_loaders", [])
        if os.environ.get(CHECK_OF_ENV):  # a run dpprof advise --check records: marked as a check of that run
            self.workload_args.setdefault("check_of", os.environ[CHECK_OF_ENV])
        self.sync_timing = sync_timing
        self.created_at = now
        self.ended_at: datetime | None = None
        self.status = "running"
        self.error: str | None = None
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.torch_version = torch.__version__
        self.cuda_version = torch.version.cuda
        self.devices: list[str] = []  # every device that recorded, in first-seen order
        self.path: str | None = None
        self.problem: str | None = None  # what went wrong with the recording, in the one line the user was told
        self.recording_failed = False  # steps were not recorded although training went on
        self.sink: Sink
        directory = None
        if store:
            directory = resolve_reports_dir(reports_dir)
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise start_failure(directory, err) from None  # one line, and nothing left behind
            fold_leftover_logs(directory)  # runs that closed on a full disk: one file again, if there is room now
            rank_part = f".rank{rank}" if rank is not None else ""  # one file per rank: a dead rank loses only its own
            # on a network or FUSE filesystem the file is recorded on local disk and moved there at close
            self.sink = open_sink(str(directory / f"{self.id}{rank_part}{RUN_SUFFIX}"), self.metadata(),
                                  retention=self.retention)
            self.path = self.sink.path
            self.sink.clock_ms = self.now_ms
        else:
            self.sink = MemorySink()
        self._lock = threading.Lock()
        self._next_step = 0
        self._explicit: _Step | None = None
        self._implicit: _Step | None = None
        # the implicit step an optimizer step ended (end_step), its record held until the next step starts or the run
        # ends, and where it ends: the optimizer steps that follow it back to back (several optimizers) are its too
        self._ended: _Step | None = None
        self._ended_at_ns = 0
        # the collectives the script called itself between steps, for the next step (dpprof.parallel.script_comms),
        # once a DDP or FSDP forward was recorded (records_comms): a DataParallel run's process has no ranks
        self.script_comms: list[Any] = []  # script_comms._Call
        self.records_comms = False
        # the parameters (ids) of each module whose forward calls opened or joined a step, and whether each optimizer
        # updates any (cached, with the count of modules it was found for): only such an optimizer's step moves an
        # ended step's end, not that of a model the run does not record (trained before the next recorded forward)
        # (by id, with a weak reference that tells a reused id apart: a module or optimizer need not be hashable)
        self._weights_of: dict[int, tuple[weakref.ref[Any], frozenset[int]]] = {}
        self._updates_recorded: dict[int, tuple[weakref.ref[Any], int, bool]] = {}
        self.last_step_end_ns: int | None = None  # where the newest closed step ended (perf_counter_ns)
        # dpprof.instrument's step rule: whether a forward call joins the open implicit step (None: never), and what
        # it is told of each recorded forward call's output where no stand-in's forward sees it (FSDP's root)
        self.joins_open_step: Callable[[_Step, int | None], bool] | None = None
        self.forward_ended: Callable[[Any], None] | None = None
        # ... and what it is told before such a forward opens its step (the module, its inputs): dpprof run's --steps
        # stops recording there, as it does before a stand-in's forward
        self.forward_starting: Callable[[Any, Any], None] | None = None
        # where set, record() hands it its close hooks (the findings computed and stored) to run rather than running
        # them: dpprof.instrument's --steps stop, whose script goes on at once, the block's end waiting for them
        self.close_hooks_later: Callable[[Callable[[], None]], None] | None = None
        self._pending: list[Any] = []  # CUDA timings whose events have not completed yet
        self._pending_lock = threading.Lock()
        self._noted: set[str] = set()
        self._device_sets: dict[int, DeviceSet] = {}  # the device sets note_devices has seen, by id
        self._cache: dict[Any, Any] = {}
        self._nvml: Nvml | None = None
        self._sampler: GpuSampler | None = None
        self._monitor_pending = False  # start_monitor ran and the sampler waits for the first GPU
        self.sample_hz = sample_hz
        # the step index at which the deep capture acts (starts, marks or stops torch.profiler): one comparison
        # per step in _new_step; NO_CAPTURE outside a window
        self.capture_edge = NO_CAPTURE
        self.capture = CaptureSession(self, window, directory)
        # where the profiler's latest start or stop ended (perf_counter_ns; 0: none yet; CaptureSession.turn): a DDP or
        # FSDP step, whose data part runs from the step before's end, begins no earlier, so no part holds either
        self.capture_turned_ns = 0

    # the GPU monitor
    def start_monitor(self, sample_gpus: bool | None = None) -> None:
        """Sample every visible GPU through NVML in the background: from now (``sample_gpus=True``),
        never (False), or (None) from when the run first uses a GPU (note_devices), so that a run on
        CPU workers samples no GPU it never touched. A missing piece is a note, not an error."""
        if not self.sample_hz or sample_gpus is False:
            return
        if not torch.cuda.is_available():
            self.note("nvml", "no CUDA GPU visible: GPU sampling is off", tell=False)
        elif sample_gpus:
            self._start_sampler()
        else:
            self._monitor_pending = True

    def _start_sampler(self) -> None:
        self._monitor_pending = False
        hz = self.sample_hz
        if not hz:  # start_monitor starts none then
            return
        try:
            self._nvml = Nvml()
        except NvmlUnavailable as err:
            self.note("nvml", f"GPU sampling is off: {err}")
            return
        self._nvml.on_reason = lambda message: self.note("nvml", message)
        handles = nvml_handles(self._nvml, range(torch.cuda.device_count()))
        self._sampler = GpuSampler(self._nvml, handles, self.emit, self.now_ms, hz=hz)

    def note(self, source: str, message: str, tell: bool = True) -> None:
        """Record why some data is missing, once per message, and tell the user in one line."""
        if message in self._noted:
            return
        self._noted.add(message)
        self.emit(NoteRecord(t_ms=self.now_ms(), source=source, message=message))
        if tell:
            log.warning("dpprof: %s", message)

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """A value computed once per run (a module's weight bytes: weights do not change size in a run)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    # clock
    def ms(self, t_ns: int) -> float:
        """A perf_counter_ns reading as milliseconds since the run started."""
        return (t_ns - self._t0_ns) / 1e6

    def now_ms(self) -> float:
        return self.ms(time.perf_counter_ns())

    # records
    def emit(self, record: Record | Row) -> None:
        """A record, or a row of one (dpprof.records.Row), to the run's sink."""
        self.sink.put(record)

    def note_devices(self, devices: DeviceSet) -> None:
        """Add devices a forward call uses; the first time, store their inventory."""
        if self._device_sets.get(id(devices)) is devices:  # a module's own set, seen at its earlier calls
            return
        if len(self._device_sets) < 64:  # held, so that its id is no other set's; a few, whoever makes new ones
            self._device_sets[id(devices)] = devices
        new = [i for i, label in zip(devices.indices, devices.labels) if label not in self.devices]
        if new:
            if self._monitor_pending:
                # GPUs in use: CUDA devices, or a DDP rank that has put work on a GPU
                if devices.type == "cuda" or (devices.type == "rank" and torch.cuda.is_initialized()):
                    self._start_sampler()
                elif devices.type == "cpu":
                    self.note("nvml", "the run uses CPU workers: the GPUs here are not sampled", tell=False)
            self.devices.extend(devices.label(i) for i in new)
            self.sink.update_run(devices=list(self.devices), backend=self.backend)
            for rec in inventory(DeviceSet(devices.type, tuple(new), devices.output_index), self._nvml):
                self.emit(rec)

    @property
    def backend(self) -> str | None:
        kinds = {d.split(":")[0] for d in self.devices}
        return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None)

    # steps
    def _new_step(self, explicit: bool) -> _Step:
        if self._ended is not None:  # the step before, ended by its optimizers: none follows now
            self._flush_ended()
        index = self._next_step
        if index == self.capture_edge:  # a deep capture starts, marks a step or stops, before the step's clock
            self.capture.turn(index)
        step = _Step(index, time.perf_counter_ns(), explicit)
        self._next_step = index + 1
        # the DataLoader's batches since the step before ended (the steps before are closed by now), in no step; a DDP
        # or FSDP rank whose step then starts where the one before ended holds them in its data part, and clears this
        lo = self.last_step_end_ns
        step.loader_ms = time_in(self._t0_ns if lo is None else lo, step.start_ns)
        return step

    def _close_step(self, step: _Step, end_ns: int) -> None:
        step.closed = True
        if step.on_close is not None:
            on_close, step.on_close = step.on_close, None
            on_close()
        self.last_step_end_ns = end_ns
        if self._pending:  # CUDA timings only: a CPU step has none
            self.resolve_pending(block=False)
        # a row (dpprof.records.Row): STEP_ROW, then StepRecord's step, start_ms, duration_ms, batch_size, devices_used,
        # forward_calls, explicit, raised_calls, loader_ms
        self.sink.put((STEP_ROW, step.index, (step.start_ns - self._t0_ns) / 1e6, (end_ns - step.start_ns) / 1e6,
                       step.batch_size, step.devices_used, step.calls, step.explicit, step.raised_calls, step.loader_ms))

    def step(self) -> _StepBlock:
        """``with run.step() as index:`` marks one training step (forward, loss, backward, optimizer).

        Raises:
            RuntimeError: the run has ended (its ``record`` block is over): its steps are stored, none is added.
        """
        if self.ended_at is not None:
            raise RuntimeError(f"run {self.id} has ended ({self.status}): run.step() marks steps inside its "
                               "dpprof.record block")
        return _StepBlock(self)

    def step_for_forward(self, starts_step: bool = True, module: object | None = None) -> _Step:
        """The step a forward call belongs to: the open run.step(), or a new implicit one.

        A call that does not start a step (DataParallelCriterion after DataParallelModel) joins
        the current implicit step. ``module``: the module called, for a step rule that tells models apart.
        """
        with self._lock:
            if module is not None:
                self._note_weights(module)
            step = self._explicit  # read once: run.step()'s exit clears it without the lock
            if step is None:
                step = self._implicit
                module_id = None if module is None else id(module)
                if step is None or (starts_step and not self._rule_joins(step, module_id)):
                    self._flush_implicit()
                    step = self._implicit = self._new_step(explicit=False)
                    if self.joins_open_step is not None:
                        step.grad, step.opened_by = torch.is_grad_enabled(), module_id
            step.calls += 1
            return step

    def open_step(self) -> _Step | None:
        """The step open now: run.step()'s, else the implicit one; None between steps."""
        with self._lock:
            return self._explicit or self._implicit

    def _rule_joins(self, step: _Step, module_id: int | None) -> bool:
        return self.joins_open_step is not None and self.joins_open_step(step, module_id)

    def optimizer_stepped(self, optimizer: Any = None) -> None:
        """An optimizer step ended now: the open implicit step, where a backward ran in it, ends no earlier (without
        run.step() a DataParallel step ended at its last phase, its backward, and its optimizer was in no step), where
        the optimizer updates a recorded module's weights (another model's, trained before the next recorded forward,
        is no part of the step)."""
        step = self._implicit  # read once: a forward on another thread may close it; touching a closed step is harmless
        if step is not None and step.passes and self._updates_weights(optimizer):
            step.touch(time.perf_counter_ns())
            step.stepped = True

    def end_step(self, optimizer: Any = None) -> None:
        """End the open implicit step now (dpprof.instrument calls it at each optimizer.step(), with the optimizer).

        Its record waits for the next step's start (or the run's end): an optimizer step made before that, with no
        forward between (the second of two optimizers stepped back to back after one backward: an embedding's
        SparseAdam, then the dense layers' Adam), ends it again, later, so that every optimizer's time is in it; unless
        the optimizer updates none of the recorded modules' weights (a model the run does not record, trained before
        the next recorded forward: its time and the loading before it are no part of the step)."""
        now = time.perf_counter_ns()
        with self._lock:
            step = self._implicit
            if step is not None:
                self._implicit = None
                step.closed = True  # ended: what a stale probe does after it belongs to no step
                self._ended, self._ended_at_ns = step, max(now, step.last_end_ns)
            elif self._ended is not None and self._explicit is None and self._updates_weights(optimizer):
                self._ended_at_ns = now

    def step_for_collective(self) -> _Step | None:
        """The step a collective the script calls now is in (dpprof.parallel.script_comms): the open run.step(), else
        the open implicit step until an optimizer stepped after its backward; None between steps (after the optimizer,
        before the next forward: the next step's, whose data part holds it)."""
        with self._lock:
            step = self._explicit or self._implicit
            return step if step is not None and not step.closed and not step.stepped else None

    def _note_weights(self, module: object) -> None:
        """Keep the parameters (ids) of a module whose forward call the run records, once (under the lock)."""
        known = self._weights_of.get(id(module))
        if known is not None and known[0]() is module:
            return
        try:
            self._weights_of[id(module)] = (weakref.ref(module), frozenset(map(id, module.parameters())))  # type: ignore[attr-defined]
        except (TypeError, AttributeError):  # no weak reference, or no parameters: nothing an optimizer updates
            pass

    def _updates_weights(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` updates weights of a module whose forward calls the run recorded (None: say so)."""
        if optimizer is None:
            return True
        known = self._updates_recorded.get(id(optimizer))
        if known is not None and known[0]() is optimizer and known[1] == len(self._weights_of):
            return known[2]
        try:
            params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        except (AttributeError, TypeError, KeyError):  # not torch.optim's shape: counted as the model's, as before
            return True
        updates = any(not params.isdisjoint(weights) for _, weights in tuple(self._weights_of.values()))
        try:
            self._updates_recorded[id(optimizer)] = (weakref.ref(optimizer), len(self._weights_of), updates)
        except TypeError:  # no weak reference: found again next time
            pass
        return updates

    def forward_starts_step(self, module: object | None = None) -> bool:
        """Whether a forward call of ``module`` made now would start a new step."""
        with self._lock:
            return self._explicit is None and (self._implicit is None or not self._rule_joins(
                self._implicit, None if module is None else id(module)))

    @property
    def steps_started(self) -> int:
        return self._next_step

    def _flush_ended(self) -> None:
        step, self._ended = self._ended, None
        if step is not None:
            self._close_step(step, self._ended_at_ns)

    def _flush_implicit(self) -> None:
        if self._implicit is not None:
            step, self._implicit = self._implicit, None
            self._close_step(step, step.last_end_ns)

    # CUDA timings that complete after the step
    def defer(self, pending: Any) -> None:
        """A record whose CUDA events may still be in flight, emitted once they complete (any thread: a DDP rank
        defers from its backward's and its collectives' threads too)."""
        with self._pending_lock:
            self._pending.append(pending)

    def resolve_pending(self, block: bool) -> None:
        if not self._pending:  # every CPU step: nothing to build a new list for
            return
        with self._pending_lock:
            items, self._pending = self._pending, []
        still = [item for item in items if not item.try_emit(self, block)]
        if still:
            with self._pending_lock:
                self._pending[:0] = still

    # lifecycle
    def close(self, status: str = "finished", error: str | None = None) -> None:
        if self._sampler is not None:
            self._sampler.close()
        if self._nvml is not None:
            self._nvml.close()
        with self._lock:
            self._flush_ended()
            self._flush_implicit()
        self.resolve_pending(block=True)
        self.capture.close()  # a window still open ends with the last step; its trace and tables are stored first
        self.status = status
        self.error = error
        self.ended_at = datetime.now(timezone.utc)
        self.sink.update_run(status=status, error=error, ended_at=self.ended_at.isoformat())
        self.sink.close(steps_total=self._next_step)
        self.path = getattr(self.sink, "path", self.path)  # a staged run's file, moved into the reports directory
        for release in RELEASE_HOOKS:
            release(self)
        self._tell()

    def _tell(self) -> None:
        """Say once, in one line on the dpprof logger, what a closed run lost or went through."""
        if self.path is None:
            return
        self.problem = getattr(self.sink, "message", None)
        self.recording_failed = getattr(self.sink, "failure", None) is not None
        if self.problem is None and self.status == "interrupted":
            kept = getattr(self.sink, "steps_kept", self._next_step)
            self.problem = f"{self.error}: {plural(kept, 'step')} kept in {self.path}"
        stays = getattr(self.sink, "stays", None)  # a staged run that could not be moved into the reports directory
        if stays is not None:
            self.problem = f"{self.problem}; {stays}" if self.problem else stays
        if self.problem is not None:
            log.warning("dpprof: %s", self.problem)

    def mark_interrupted(self, signum: int) -> None:
        """A signal arrived that the program handles itself: store the run as interrupted now, in case
        that handler ends the process."""
        self.sink.update_run(status="interrupted", error=self._interrupted_by(signal_name(signum)))
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    def _interrupted_by(self, what: str) -> str:
        return f"interrupted by {what} after {plural(self._next_step, 'step')}"

    def note_workload(self, **values: Any) -> None:
        """Add to the run's workload_args (what the script turned out to train: an FSDP1 model built after the run
        started), stored with the run."""
        if any(self.workload_args.get(k) != v for k, v in values.items()):
            self.workload_args.update(values)
            self.sink.update_run(workload_args=dict(self.workload_args))

    def note_data_loader(self, found: dict[str, Any]) -> None:
        """Keep a DataLoader's settings (``found``: dpprof.loaders.describe) the first time the run sees them, up to
        MAX_LOADERS: the data_loading finding's advice reads them."""
        seen = list(self.workload_args.get("data_loaders") or [])
        if found not in seen and len(seen) < MAX_LOADERS:
            self.note_workload(data_loaders=[*seen, found])

    def metadata(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "created_at": self.created_at.isoformat(),
            "ended_at": self.ended_at.isoformat() if self.ended_at else None, "host": self.host,
            "pid": self.pid, "torch_version": self.torch_version, "cuda_version": self.cuda_version,
            "backend": self.backend, "devices": list(self.devices), "status": self.status, "error": self.error,
            "workload": self.workload, "workload_args": self.workload_args,
            "rank": self.rank, "world_size": self.world_size,
        }

    def frames(self) -> dict[str, pd.DataFrame]:
        """The run's records as one DataFrame per table (read back from its file once it is closed)."""
        if not isinstance(self.sink, MemorySink):
            if self.ended_at is None:
                raise RuntimeError("the run is still recording; read it after the with block")
            assert self.path is not None, "a closed run stored in a file has its path"
            return load_run(self.path).frames()
        out = {}
        for cls, table in TABLE_OF.items():
            rows = self.sink.tables[table]
            columns = [f.name for f in fields(cls)]
            out[table] = typed(table, pd.DataFrame([asdict(r) for r in rows], columns=columns))
        return out


@contextmanager
def record(name: str | None = None, reports_dir: str | os.PathLike[str] | None = None,
           sync_timing: bool = False, workload: str | None = None,
           workload_args: dict[str, Any] | None = None, store: bool = True,
           sample_hz: float | None = DEFAULT_SAMPLE_HZ, sample_gpus: bool | None = None,
           detail: str | Retention = "bounded", run_id: str | None = None,
           capture: str | CaptureWindow | None = None) -> Iterator[Run]:
    """Record every dpprof DataParallel call made inside the block into one run.

    Args:
        name: a name for the run (default: its id).
        reports_dir: where the run file goes (default: $DPPROF_REPORTS, else ./reports).
        sync_timing: on CUDA, synchronize at each phase end so host times equal device times.
        workload: what is being trained, and workload_args its settings, stored with the run.
        store: False keeps the records in memory only (run.frames() still works).
        sample_hz: how often the GPU monitor samples NVML (None or 0: off).
        sample_gpus: None (default): sample every visible GPU from the run's first use of a GPU (CUDA
            devices, or a DDP rank with work on a GPU), so a CPU-worker run samples none; True: from
            the start of the block (a script whose GPU work dpprof does not wrap); False: never.
        detail: "bounded" (default): every step's duration and per-block aggregates of everything, with full
            detail for the first and last 1,000 steps, one step in 100, outlier steps and their neighbours
            and each device's peak step (dpprof.store.retention), so a day-long run keeps a small file;
            "all": every record of every step.
        run_id: the run's id, chosen by the caller before the start (dpprof.launch.Profile.with_run_id), so
            whoever started this process knows its run without looking for it (default: a new one). Under
            torch.distributed, rank 0's is every rank's.
        capture: "A:B": profile steps A to B-1 with torch.profiler (every thread, CUDA too on a GPU; shapes,
            memory, modules) and store their operators, kernels and memory in the run per device, the raw trace
            beside it for Perfetto (dpprof.capture). Steps outside the window cost what they cost without it.
            A running run also captures on request (``dpprof capture RUN --steps N``).

    Under torch.distributed with more than one rank, every rank must enter ``record`` (it is a
    collective): rank 0 names the run, and each rank writes its own file of that run.

    Records nest within one thread (the innermost takes the calls); a record in a second thread while one is open
    in another is refused (RuntimeError, before any file is made): the runs could not tell whose calls are whose.

    Example:
        >>> with dpprof.record(name="baseline") as run:
        ...     for x, y in loader:
        ...         with run.step():
        ...             loss = criterion(net(x), y); loss.backward(); opt.step()
    """
    with _start_lock:  # two threads starting at once: one is refused, never both recorded
        with _active_lock:
            other = next((r for r in _active if r.thread_id != threading.get_ident()), None)
        if other is not None:
            raise RuntimeError(f"run {other.id} is being recorded in another thread: dpprof records one thread's "
                               "training at a time (records nest within a thread); record this one after it ends")
        run_id, name, rank, world_size = _distributed_identity(name, run_id)
        if rank is not None:  # the torch.distributed backend (gloo, nccl), for the pages and listings to name
            import torch.distributed as dist

            workload_args = {"backend": dist.get_backend(), **(workload_args or {})}
        # SIGTERM/SIGHUP: flush, mark interrupted, then end. Installed before the run's file is made and held while
        # it is (a signal then waits), so no signal finds a run file without the run that closes it
        guard = SignalGuard().install()
        guard.hold()
        try:
            run = Run(name=name, reports_dir=reports_dir, sync_timing=sync_timing, workload=workload,
                      workload_args=workload_args, store=store, sample_hz=sample_hz, run_id=run_id, rank=rank,
                      world_size=world_size, detail=detail, capture=capture)
        except BaseException:  # no run (nothing left behind): a signal held meanwhile does what it would have done
            guard.restore()
            if guard.pending is not None:
                guard.deliver(guard.pending)
            guard.deliver_interrupt()
            raise
        guard.on_chain = run.mark_interrupted
        for found in claim():  # an iterator made before the run started, iterated in it
            run.note_data_loader(found)
        _install_optimizer_hook()
        with _active_lock:
            _active.append(run)
    try:
        guard.release()  # a signal that came while the run started: acts now, and the run closes as interrupted
        run.start_monitor(sample_gpus)
        yield run
    except BaseException as err:
        guard.hold()
        with _active_lock:
            _active.remove(run)
        if isinstance(err, Interrupted):
            run.close(status="interrupted", error=run._interrupted_by(str(err)))
        elif isinstance(err, KeyboardInterrupt):
            run.close(status="interrupted", error=run._interrupted_by("SIGINT (Ctrl-C)"))
        elif guard.received is not None:
            run.close(status="interrupted", error=f"{run._interrupted_by(signal_name(guard.received))}, "
                                                  f"then {type(err).__name__}: {err}")
        else:
            run.close(status="failed", error=f"{type(err).__name__}: {err}")
        guard.restore()
        if isinstance(err, Interrupted):
            guard.deliver(err.signum, only_default=True)  # the process ends by the signal, as without dpprof
        raise  # a Ctrl-C held while closing adds nothing to the error on its way up
    guard.hold()
    with _active_lock:
        _active.remove(run)
    if guard.received is not None:  # the program's own handler let training go on to the end
        run.close(status="interrupted", error=run._interrupted_by(signal_name(guard.received)))
    else:
        run.close(status="finished")
    guard.restore()
    if guard.pending is not None:  # arrived while the run closed: now do what it would have done
        guard.deliver(guard.pending)
    guard.deliver_interrupt()  # a Ctrl-C while the run closed: KeyboardInterrupt now, the run whole
    if run.path is not None and not run.recording_failed:
        hooks = tuple(CLOSE_HOOKS)
        if run.close_hooks_later is not None:  # the script goes on past the run (dpprof run --steps): not waited for
            run.close_hooks_later(lambda: _run_hooks(run, hooks))
        else:
            _run_hooks(run, hooks)


def _run_hooks(run: Run, hooks: tuple[Callable[[Run], None], ...]) -> None:
    for hook in hooks:
        hook(run)
