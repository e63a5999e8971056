"""torch.profiler inside a recording: the deep captures of one run (dpprof.recording.Run owns one).

The run calls :meth:`CaptureSession.turn` from its step boundary (Run._new_step, under the run's lock, before the
step's clock starts) when the step about to begin is ``run.capture_edge``: the window's first step starts the
profiler, each later step of the window closes the previous ``ProfilerStep#N`` range and opens its own (as
torch.profiler.profile.step() does), and the step after the window stops the profiler. Outside a window
``capture_edge`` is -1 and a step costs the run one integer comparison.

The profiler records CPU activities, and CUDA's on a run that uses a GPU, with shapes and memory. How depends on
where the model runs (torch 2.13 cannot have both):

- a DataParallel run's replicas run on threads of their own (the CPU workers, started before the profiler): it
  records every thread (``profile_all_threads``), building no Python events at its stop (``trace_only``). torch
  then reports no ``[memory]`` events at all, and Python's calls (the module tree) of no thread;
- a DDP or FSDP rank trains on the thread that starts the profiler (autograd's threads inherit its state): the
  profiler of that thread, with ``[memory]`` events and Python's calls with module ids (``with_stack``,
  ``with_modules``), so the capture has memory over time, memory events and modules.

Its stop runs on the training thread; the raw trace is written and aggregated into the run's operator tables on a
thread of the session's own while training goes on.

On CPU workers each worker thread's ops go to its device (dpprof.parallel.workers.worker_native_ids); the
training thread's own ops (scatter, gather, the loss, backward, which CPU autograd runs on the thread that calls
it, and the optimizer) go to TRAINING_THREAD_DEVICE.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from dpprof.capture.request import CaptureAnswer, read_request, write_answer
from dpprof.capture.window import CaptureError, CaptureWindow
from dpprof.records import NoteRecord
from dpprof.store.faults import cause_of
from dpprof.store.files import capture_trace_name, hidden_name, publish_file, remove_files
from dpprof.units import plural, steps_words

if TYPE_CHECKING:
    from dpprof.recording import Run

__all__ = ["CaptureSession", "CapturedWindow", "REQUEST_POLL_S", "TRAINING_THREAD_DEVICE", "NO_CAPTURE", "NOT_STORED"]

log = logging.getLogger("dpprof")
# the words between a window's steps and why it was not stored, in its note and its warning: what dpprof profile reads
# in a DDP run's notes to fail the command
NOT_STORED = " not stored: "

NO_CAPTURE = -1  # Run.capture_edge when no capture is due: no step index equals it
# How often a run looks for a request from `dpprof capture` (a stat of one file, on the session's own thread): a
# person asking waits at most this long for the next step boundary to be the start.
REQUEST_POLL_S = 1.0
# Where the training thread's ops go on CPU workers: DataParallel's host side (scatter, replicate, gather, the loss,
# backward, which CPU autograd runs on the calling thread, and the optimizer), which belongs to no worker; counting
# it under cpu:0 would make the output device look slower than the others for work it did not do.
TRAINING_THREAD_DEVICE = "host"


@dataclass(frozen=True)
class CapturedWindow:
    """A capture that ended: its steps, its raw trace (a path; None where it could not be written), and why not."""

    first_step: int
    end_step: int
    trace: str | None
    error: str | None = None
    stop_ms: float = 0.0  # the profiler's stop on the training thread
    export_ms: float = 0.0  # the raw trace written and aggregated, on the session's own thread


class CaptureSession:
    """The deep captures of one run: a window given at the start, and windows asked for while it runs.

    Args:
        run: the run (its ``capture_edge``, ``_next_step``, ``_lock``, ``path``, ``id`` and ``note``).
        window: steps to capture, or None (only on request).
        directory: the reports directory, where raw traces go and requests are looked for; None: a run kept in
            memory, which captures nothing (there is nowhere to keep a trace).
    """

    def __init__(self, run: Run, window: CaptureWindow | None, directory: Path | None) -> None:
        self.run = run
        self.directory = directory
        self.window: CaptureWindow | None = None
        self.captured: list[CapturedWindow] = []
        self._nonce: str | None = None  # the request the current window answers
        self._handled: set[str] = set()
        self._profiler: Any = None  # torch.profiler.profile while a window records
        self._step_range: Any = None  # the open ProfilerStep#N range
        self._first = 0
        self._first_ms = 0.0  # when ProfilerStep#first began, on the run's clock (the trace's times are moved onto it)
        self._training_tid = 0  # the thread that started the profiler: the run's training thread
        self._jobs: list[threading.Thread] = []
        self._closing = threading.Event()
        self._poller: threading.Thread | None = None
        if directory is None:
            if window is not None:
                run.note("capture", f"capture {window}: a run kept in memory (store=False) keeps no trace; "
                                    "no capture")
            return
        if window is not None:
            self._schedule(window, None)
        self._poller = threading.Thread(target=self._poll, name=f"dpprof-capture-{run.id}", daemon=True)
        self._poller.start()

    # -- the step boundary (training thread, under the run's lock) ---------------------------------------------

    def _schedule(self, window: CaptureWindow, nonce: str | None) -> None:
        self.window, self._nonce = window, nonce
        self.run.capture_edge = window.first_step

    def turn(self, index: int) -> None:
        """Step ``index`` is about to begin and is the capture's edge: start, mark or stop the profiler."""
        window = self.window
        if window is None:
            self.run.capture_edge = NO_CAPTURE
            return
        if self._profiler is None:
            self._start(window, index)
        elif index < window.end_step:
            self._mark(index)
            return
        else:
            self._stop(index)
        # no step's clock holds the start or the stop (a DDP or FSDP step's data part begins no earlier), while the
        # steps the window marks (a range's exit and entry, microseconds) keep their data parts
        self.run.capture_turned_ns = time.perf_counter_ns()

    def _start(self, window: CaptureWindow, index: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        on_workers = self.run.rank is None  # DataParallel: replicas on threads of their own (the module docstring)
        config = _experimental_config() if on_workers else None
        if on_workers and config is None:
            self.run.note("capture", f"torch {torch.__version__} cannot profile every thread (profile_all_threads): "
                                     "the capture sees the training thread only, not the CPU workers'")
        profiler = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=not on_workers,
                           with_modules=True, experimental_config=config)
        try:
            profiler.start()
        except Exception as err:  # noqa: BLE001 - another profiler running, a build without kineto: a note
            self._give_up(window, f"capture {window} did not start: torch.profiler: {_first_line(err)}")
            return
        self._profiler, self._first = profiler, index
        self._training_tid = threading.get_native_id()
        self._first_ms = self.run.now_ms()
        self._mark(index)

    def _mark(self, index: int) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
        self._step_range = record_function(f"ProfilerStep#{index}")
        self._step_range.__enter__()
        self.run.capture_edge = index + 1

    def _stop(self, end_step: int) -> None:
        """Stop the profiler before step ``end_step`` begins (or at the run's close) and hand its trace on."""
        window, profiler = self.window, self._profiler
        assert window is not None
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        t0 = time.perf_counter()
        error = None
        try:
            profiler.stop()
        except Exception as err:  # noqa: BLE001 - said in a note, never raised in training
            error = f"torch.profiler's stop failed: {_first_line(err)}"
        stop_ms = (time.perf_counter() - t0) * 1e3
        self._profiler, self.window = None, None
        self.run.capture_edge = NO_CAPTURE
        # at least the window's first step: a run that failed as its window began (the profiler started, the step not)
        # still stops the profiler and stores what it holds, and its own error is the one raised
        steps = CaptureWindow(self._first, max(end_step, self._first + 1))
        cut = window if steps.end_step < window.end_step else None  # the run ended inside the window
        job = threading.Thread(target=self._store, args=(profiler, steps, self._nonce, error, stop_ms,
                                                         self._device_of_thread(), self._first_ms, cut),
                               name=f"dpprof-capture-store-{self.run.id}", daemon=True)
        self._jobs.append(job)
        job.start()

    def _give_up(self, window: CaptureWindow, message: str) -> None:
        self.run.capture_edge = NO_CAPTURE
        self.window = None
        self.run.note("capture", message)
        if self._nonce is not None and self.directory is not None:
            write_answer(self.directory, self.run.id, CaptureAnswer(request=self._nonce, error=message), self.run.rank)

    def _device_of_thread(self) -> dict[int, str] | None:
        """Each thread's device for the aggregation: CPU workers' threads their own, the training thread
        TRAINING_THREAD_DEVICE; None on GPUs, where each kernel says its device, and for a DDP or FSDP rank, whose
        threads are its rank's (_process_device)."""
        if self.run.backend != "cpu":  # GPUs, or a DDP or FSDP rank (its devices are rank:N): _process_device
            return None
        # here, not at the top: dpprof.parallel records into runs (it imports dpprof.recording, which imports this)
        from dpprof.parallel.workers import worker_native_ids

        out = {tid: f"cpu:{index}" for tid, index in worker_native_ids().items()}
        out[self._training_tid] = TRAINING_THREAD_DEVICE
        return out

    def _process_device(self) -> str | None:
        """The device of the trace's threads where it shows no GPU: a DDP or FSDP rank's is ``rank:N``, as its
        phases are (and as an imported rank file's are); None for DataParallel (cpu:0)."""
        return f"rank:{self.run.rank}" if self.run.rank is not None else None

    # -- after the window (the session's own thread) -------------------------------------------------------------

    def _store(self, profiler: Any, steps: CaptureWindow, nonce: str | None, error: str | None, stop_ms: float,
               device_of_thread: dict[int, str] | None, first_ms: float, cut: CaptureWindow | None = None) -> None:
        """Write the raw trace beside the run, aggregate it into the run's tables, note it, answer a request;
        ``cut``: the window asked for, where the run ended inside it."""
        t0 = time.perf_counter()
        trace: str | None = None
        if error is None:
            try:
                trace = self._write_trace(profiler, steps)
                self._aggregate(trace, steps, device_of_thread, first_ms)
            except FileExistsError as err:  # a file of the trace's name, never replaced: another run's of this id
                error = f"{os.path.basename(str(err.filename2 or err.filename))} is there already (never replaced)"
            except OSError as err:  # a full disk, a read-only directory: in a few words
                error = f"{cause_of(err, str(self.directory))} writing its raw trace"
            except Exception as err:  # noqa: BLE001 - a trace the aggregation refuses: a note
                error = f"{type(err).__name__}: {_first_line(err)}"
        export_ms = (time.perf_counter() - t0) * 1e3
        done = CapturedWindow(steps.first_step, steps.end_step, trace, error, stop_ms, export_ms)
        self.captured.append(done)
        if error is None:
            short = (f" (of the window {cut}: the run ended after {plural(steps.end_step, 'step')})"
                     if cut is not None else "")
            message = (f"captured {steps_words(steps.first_step, steps.end_step)} with torch.profiler{short}: raw trace "
                       f"{os.path.basename(str(trace))} (stop {stop_ms:.0f} ms on the training thread, trace and "
                       f"tables {export_ms:.0f} ms beside it)")
        else:
            message = f"capture of {steps_words(steps.first_step, steps.end_step)}{NOT_STORED}{error}"
        self.run.emit(NoteRecord(t_ms=self.run.now_ms(), source="capture", message=message))
        if error is not None:
            log.warning("dpprof: %s", message)
        if nonce is not None and self.directory is not None:
            name = os.path.basename(trace) if trace else None
            write_answer(self.directory, self.run.id, CaptureAnswer(request=nonce, first_step=steps.first_step,
                                                                    end_step=steps.end_step, trace=name, error=error),
                         self.run.rank)

    def _write_trace(self, profiler: Any, steps: CaptureWindow) -> str:
        assert self.directory is not None and self.run.path is not None
        path = str(self.directory / capture_trace_name(self.run.path, steps.first_step, steps.end_step))
        built = hidden_name(path).removesuffix(".part")  # a dot-name ending in .gz: torch gzips it
        try:
            profiler.export_chrome_trace(built)
            publish_file(built, path)  # never over an existing file (a run's earlier capture of the same steps)
        finally:
            remove_files(built)
        return path

    def _aggregate(self, trace: str, steps: CaptureWindow, device_of_thread: dict[int, str] | None,
                   first_ms: float) -> None:
        """The trace's tables into the run file, beside its earlier captures' (each kept under its first step), their
        times (memory over time, memory events, GPU streams' spans) on the run's clock: ``first_ms``, when the
        window's first step began."""
        from dpprof.store.detail_rows import Capture, write_detail
        from dpprof.trace.detail import detail_of_trace

        assert self.run.path is not None
        write_detail(self.run.path, detail_of_trace(trace, device_of_thread, process_device=self._process_device(),
                                                    first_step_ms=first_ms),
                     Capture(steps.first_step, steps.end_step, (os.path.basename(trace),)))

    # -- requests (the session's own thread) ---------------------------------------------------------------------

    def _poll(self) -> None:
        assert self.directory is not None
        while not self._closing.wait(REQUEST_POLL_S):
            found = read_request(self.directory, self.run.id)
            if found is None or found[0] in self._handled:
                continue
            nonce, steps, first = found
            self._handled.add(nonce)
            rank = self.run.rank
            with self.run._lock:
                busy = self.window is not None or any(job.is_alive() for job in self._jobs)
                started = self.run.steps_started  # the next step to begin
                if not busy and (first is None or first >= started):
                    try:  # a distributed run's ranks all start at the step the request names; one process at its next
                        start = started if first is None else first
                        self._schedule(CaptureWindow(start, start + steps), nonce)
                    except CaptureError as err:
                        write_answer(self.directory, self.run.id, CaptureAnswer(request=nonce, error=str(err)), rank)
                    continue
                window, profiling, own = self.window, self._profiler is not None, self._nonce is None
            if window is not None and not profiling and own:  # the run's own --capture window, later on
                error = (f"this run captures {steps_words(window.first_step, window.end_step)} (its --capture "
                         f"{window}), which begin later: one capture at a time; ask again once it is stored")
            elif window is not None:  # recording, or asked for and about to begin
                error = (f"a capture of {steps_words(window.first_step, window.end_step)} is under way in this run; "
                         "ask again once it is stored")
            elif busy:
                error = "a capture is being stored; ask again in a moment"
            else:
                error = f"step {first} had begun ({started} steps) when the request was read; ask again"
            write_answer(self.directory, self.run.id, CaptureAnswer(request=nonce, error=error), rank)

    def wait(self, timeout_s: float | None = None) -> list[CapturedWindow]:
        """Wait until every window that ended is stored (trace written, tables in the run); the windows stored."""
        for job in list(self._jobs):
            job.join(timeout_s)
        return list(self.captured)

    # -- the run's close ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """At the run's close (its last step ended): stop a window still recording (it holds the steps up to the
        last), answer a request whose window never began, and wait for the traces to be stored."""
        self._closing.set()
        with self.run._lock:
            window = self.window
            if window is not None and self._profiler is not None:
                self._stop(self.run.steps_started)
            elif window is not None:
                self._give_up(window, _never_began(window, self.run.steps_started, own=self._nonce is None))
        if self._poller is not None:
            self._poller.join()
        for job in self._jobs:
            job.join()


def _never_began(window: CaptureWindow, steps: int, own: bool) -> str:
    """What a window the run ended before says: that nothing was captured, and for the run's own window (--capture
    A:B, capture="A:B") the window that would have been, over its last steps."""
    ended = f"the run ended after {plural(steps, 'step')}" if steps else "the run ended before its first step"
    said = f"capture {window}: {ended}, before the window began, so nothing was captured"
    if not own or not steps:  # a request (dpprof capture) came too late; a run of no step has no window to give
        return said
    first = max(0, steps - window.steps)
    return (f"{said}: give a window that ends by step {steps}, such as {first}:{steps} (its last "
            f"{plural(steps - first, 'step')})")


def _experimental_config() -> Any:
    """torch.profiler's settings for a capture: every thread, and no Python events built at stop (``trace_only``)
    where this torch has it; None where it cannot profile every thread."""
    make: Any = torch._C._profiler._ExperimentalConfig
    try:
        return make(profile_all_threads=True, trace_only=True)
    except TypeError:  # a torch without trace_only
        pass
    try:
        return make(profile_all_threads=True)
    except TypeError:  # nor profile_all_threads
        return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
