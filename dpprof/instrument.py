"""dpprof.instrument: record a training script that was never written for dpprof.

Inside ``with dpprof.instrument(...)`` torch's ``DataParallel``, ``data_parallel`` and
``DistributedDataParallel``, under every name torch exports them by, are dpprof's recording
subclasses (the stand-ins); leaving the block puts torch's own back. A stand-in keeps the face of
torch's class: its name, module and ``state_dict()`` keys are torch's, ``isinstance`` holds both
ways (an instance of torch's class is an instance of the stand-in too), and a pickled stand-in
(``torch.save(model)``, ``copy.deepcopy``) is written as torch's class with torch's attributes, so a
checkpoint loads without dpprof.

A training step ends at each ``optimizer.step()`` (torch's global optimizer step hook; at the last of several stepped
back to back with no forward between, as an embedding's optimizer and the dense layers'), so the
forward calls of gradient accumulation share a step; a forward under no_grad, or with neither a
backward nor an optimizer step before it (evaluation) nor another model's output among its inputs, starts a step of
its own, which a forward with grad of another model then joins (a distillation's teacher, then its student).
``dpprof run script.py`` is this around ``runpy``.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from dpprof.capture.window import parse_capture
from dpprof.device_ids import MAX_CPU_WORKERS, MAX_DEVICE_INDEX, cpu_devices, is_cpu_worker_list, resolve_devices
from dpprof.nvml import DEFAULT_SAMPLE_HZ
from dpprof.parallel import distributed as _ddp
from dpprof.parallel import fsdp as _fsdp
from dpprof.parallel import script_comms
from dpprof.parallel.data_parallel import DataParallel as _DataParallel
from dpprof.parallel.data_parallel import data_parallel as _data_parallel
from dpprof.parallel.probe import iter_tensors, watch_passes
from dpprof.imports import WhenImported
from dpprof.parallel.workers import on_worker_thread
from dpprof.recording import CLOSE_HOOKS, Run, record

__all__ = ["instrument", "NO_PARALLEL_NOTE", "NO_OPTIMIZER_NOTE", "SPAWNED_NOTE", "FAILED_BUILD_NOTE"]

NO_OPTIMIZER_NOTE = ("no torch.optim optimizer stepped, so no step ended: the {:,} backward passes were taken for "
                     "gradient accumulation in few steps. A script that updates its weights by hand has no step "
                     "boundary dpprof can see: wrap each step in run.step() (dpprof.instrument)")
NO_PARALLEL_NOTE = ("the script built no DataParallel, DistributedDataParallel or FSDP (nor called data_parallel "
                    "or fully_shard): nothing was recorded")
# the same, where the script recorded itself: dpprof.record, or a dpprof.instrument block of its own (which dpprof run
# yields to)
OWN_RUN_NOTE = "the script recorded itself (dpprof.record or dpprof.instrument), into {}: nothing was recorded here"
# the same, where the script started processes of its own (torch.multiprocessing.spawn's ranks, the DDP tutorial's
# way): a spawned interpreter has none of dpprof's stand-ins, so what they build is not recorded
SPAWNED_NOTE = ("the script built no DataParallel, DistributedDataParallel or FSDP in its own process; it started "
                "{} of its own ({}), which dpprof run does not reach: nothing was recorded. Start the ranks with "
                "torchrun (torchrun --nproc_per_node=N -m dpprof run train.py), or record in each with "
                "dpprof.instrument or dpprof.record")
# the same, where what the script built raised as it was built (FSDP1 with no accelerator, DDP with no process group)
FAILED_BUILD_NOTE = "the script's {} raised as it was built (the run's error says why): nothing was recorded"
_DATALOADER_WORKER = "torch.utils.data._utils.worker._worker_loop"  # a DataLoader's worker: builds no model

# torch.nn.parallel.data_parallel is also the name of the function, so the modules are looked up
_TORCH_DP = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel
_TORCH_DATA_PARALLEL = importlib.import_module("torch.nn.parallel.data_parallel").data_parallel
_TORCH_DDP = importlib.import_module("torch.nn.parallel.distributed").DistributedDataParallel

# Every name torch exports each of them by: (module, attribute)
_NAMES = {
    "DataParallel": [("torch.nn", "DataParallel"), ("torch.nn.parallel", "DataParallel"),
                     ("torch.nn.parallel.data_parallel", "DataParallel")],
    "data_parallel": [("torch.nn.parallel", "data_parallel"), ("torch.nn.parallel.data_parallel", "data_parallel")],
    "DistributedDataParallel": [("torch.nn.parallel", "DistributedDataParallel"),
                                ("torch.nn.parallel.distributed", "DistributedDataParallel")],
    "fully_shard": [("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.fsdp._fully_shard", "fully_shard"),
                    ("torch.distributed._composable.fsdp", "fully_shard")],
}

_session: _Session | None = None


@contextmanager
def _building(name: str) -> Iterator[None]:
    """Around a stand-in's construction: where torch's constructor raises, the session notes what (the run's empty
    note names it, not "built nothing")."""
    try:
        yield
    except BaseException:
        if _session is not None:
            _session.failed_builds.append(name)
        raise


class _StandIn(type):
    """The stand-ins' metaclass: torch's original class and its instances count as the stand-in's."""

    def __instancecheck__(cls, obj: Any) -> bool:
        original = cls.__dict__.get("_dpprof_original")
        return super().__instancecheck__(obj) or (original is not None and isinstance(obj, original))

    def __subclasscheck__(cls, sub: type) -> bool:
        original = cls.__dict__.get("_dpprof_original")
        return super().__subclasscheck__(sub) or (original is not None and issubclass(sub, original))


class _StandInABC(_StandIn, type(_TORCH_DDP)):  # DDP is Joinable, an abstract base class
    pass


def _pickled_class(obj: Any) -> type:
    """The class a stand-in instance is pickled as: whatever torch's name holds now (the stand-in
    inside an instrument block, torch's own class after it); a user's subclass stays itself."""
    cls = type(obj)
    original = cls.__dict__.get("_dpprof_original")
    if original is None:
        return cls
    return getattr(importlib.import_module(original.__module__), original.__qualname__)


def _reduce(obj: Any, protocol: int) -> tuple[Any, ...]:
    """Pickled as torch's class (copyreg's plain reconstructor: __newobj__ insists on the object's own class)."""
    import copyreg

    return copyreg._reconstructor, (_pickled_class(obj), object, None), obj.__getstate__()


class _SessionForward:
    """A stand-in's forward: the session learns of each call (steps end at optimizer.step())."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        session = _session
        if session is None or on_worker_thread():  # none, or inside a replica: the outer call's step
            return super().forward(*inputs, **kwargs)
        session.before_forward(self._modules.get("module"), inputs, kwargs)
        try:
            output = super().forward(*inputs, **kwargs)
        finally:
            session.forward_inputs = None
        session.after_forward(output)
        return output


class DataParallel(_SessionForward, _DataParallel, metaclass=_StandIn):
    """torch.nn.DataParallel inside an instrument block: dpprof.DataParallel wearing torch's name."""

    _dpprof_original = _TORCH_DP

    def __init__(self, module: torch.nn.Module, device_ids: Sequence[Any] | None = None,
                 output_device: Any = None, dim: int = 0) -> None:
        session = _session
        workers = session.cpu_workers_for(device_ids) if session is not None else None
        if workers is not None:  # the script's output_device names a GPU: the output goes to the first worker
            device_ids, output_device = workers, None
        elif not torch.cuda.is_available() and not is_cpu_worker_list(device_ids):
            device_ids = output_device = None  # torch's pass-through: with no GPU, its device_ids are not looked at
        with _building("DataParallel"):
            super().__init__(module, device_ids, output_device, dim)
        self.__dict__["_dpprof_cpu_workers"] = workers is not None
        if session is not None:
            session.built()

    def __getstate__(self) -> dict[str, Any]:
        """torch's DataParallel's attributes, as torch would have set them."""
        state = super().__getstate__()
        for key in ("_devices", "_probe", "_rng_checked"):  # dpprof.DataParallel's own
            state.pop(key, None)
        if state.pop("_dpprof_cpu_workers", False):  # torch's pass-through: no devices, nothing else set
            state["device_ids"] = []
            for key in ("dim", "output_device", "src_device_obj"):
                state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        device_ids = self.__dict__.get("device_ids") or []
        out = self.__dict__.get("output_device")
        if isinstance(out, torch.device) and out.type == "cpu":  # CPU workers' cpu:N, or cpu: the host (-1)
            out = out if out.index is not None else -1
            device_ids = [torch.device("cpu", i) for i in device_ids]  # their indices, as torch keeps device_ids
        self.__dict__["_devices"] = resolve_devices(device_ids, out) if device_ids else None
        self.__dict__["_probe"] = None
        self.__dict__["_dpprof_cpu_workers"] = False

    __reduce_ex__ = _reduce


class DistributedDataParallel(_SessionForward, _ddp.DistributedDataParallel, metaclass=_StandInABC):
    """torch.nn.parallel.DistributedDataParallel inside an instrument block, recorded per rank."""

    _dpprof_original = _TORCH_DDP

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _building("DistributedDataParallel"):
            super().__init__(*args, **kwargs)
        session = _session
        if session is not None:
            session.built()

    def __getstate__(self) -> dict[str, Any]:
        """torch's DDP state: dpprof's attributes dropped, its timing hook unwrapped to the user's own."""
        state = super().__getstate__()
        for key in ("_dpprof_cuda", "_dpprof_probe", "_dpprof_hooked", "_dpprof_previous", "_dpprof_chosen",
                    "_dpprof_builtin", "_dpprof_hook_name", "_dpprof_span"):
            state.pop(key, None)
        hooks = []
        for hook, hook_state in state.get("_comm_hooks", []):
            inner = getattr(hook, "_dpprof_inner", hook)
            if inner is not hook and inner is _ddp.allreduce_hook:
                continue  # the hook dpprof registered itself: torch's default all-reduce
            hooks.append((inner, hook_state))
        if "_comm_hooks" in state:
            state["_comm_hooks"] = hooks
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.update(_dpprof_cuda=_ddp.gpu_of(self.module), _dpprof_probe=None, _dpprof_hooked=False,
                             _dpprof_previous=None)

    __reduce_ex__ = _reduce


for _cls, _original in ((DataParallel, _TORCH_DP), (DistributedDataParallel, _TORCH_DDP)):
    _cls.__module__, _cls.__qualname__, _cls.__name__ = _original.__module__, _original.__qualname__, _original.__name__
    _cls.__doc__ = _original.__doc__


def data_parallel(module: torch.nn.Module, inputs: Any, device_ids: Sequence[Any] | None = None,
                  output_device: Any = None, dim: int = 0, module_kwargs: Any | None = None) -> Any:
    """torch.nn.parallel.data_parallel inside an instrument block: dpprof's, recorded."""
    session = _session
    workers = session.cpu_workers_for(device_ids) if session is not None else None
    if workers is None and not is_cpu_worker_list(device_ids) and not torch.cuda.is_available():
        return _TORCH_DATA_PARALLEL(module, inputs, device_ids, output_device, dim, module_kwargs)  # torch's error
    if workers is not None:
        output_device = None  # the first worker
    if session is not None:
        session.built()
        session.before_forward(module, inputs, module_kwargs)
    try:
        output = _data_parallel(module, inputs, workers or device_ids, output_device, dim, module_kwargs)
    finally:
        if session is not None:
            session.forward_inputs = None
    if session is not None:
        session.after_forward(output)
    return output


data_parallel.__module__, data_parallel.__doc__ = _TORCH_DATA_PARALLEL.__module__, _TORCH_DATA_PARALLEL.__doc__

# torch.distributed.fsdp costs a second to import (DTensor, sympy): it is patched when the script imports it
_FSDP_MODULE = "torch.distributed.fsdp"


def _torch_fully_shard() -> Any:
    """torch's fully_shard (FSDP2), or None in a torch built without torch.distributed."""
    try:
        return importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard").fully_shard
    except ImportError:
        return None


def fully_shard(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed.fsdp.fully_shard inside an instrument block: torch's, the run started at its first call
    (under torchrun, when the process group is up); dpprof.parallel.fsdp records the steps."""
    with _building("fully_shard"):
        module = _torch_fully_shard()(*args, **kwargs)
    session = _session
    if session is not None:
        session.built()
    return module


_STAND_INS = {"DataParallel": DataParallel, "data_parallel": data_parallel,
              "DistributedDataParallel": DistributedDataParallel, "fully_shard": fully_shard}


def _under_launcher() -> bool:
    """One of several ranks started by torchrun whose process group is not up yet."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    return not initialized and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


class _Session:
    """One instrument block: the patched names, the run (started at once, or under torchrun at the
    first DataParallel, DDP or fully_shard, when the process group is up), the step rule and the --steps limit."""

    def __init__(self, record_args: dict[str, Any] | None, cpu_workers: int | None, steps: int | None) -> None:
        self.record_args = record_args  # None: the stand-ins and CPU workers, nothing recorded
        self.cpu_workers = cpu_workers
        self.steps = steps
        self.run: Run | None = None
        self._recording: AbstractContextManager[Run] | None = None
        self.started = False  # a start was tried (it may have failed)
        self.stopped = False  # recording ended before the block did (--steps, or a failure)
        self.built_any = False
        self.failed_builds: list[str] = []  # what the script's constructors raised in (DataParallel, fully_shard)
        self.started_processes: list[str] = []  # what each process the script started runs (DataLoader workers not)
        self.optimizer_seen = False
        self.optimizer_steps = 0  # optimizer.step() calls seen by the hook (a GradScaler's skipped step is not one)
        self.backward_seen = False
        self.backwards = 0  # backward passes through a recorded forward's output
        # the stand-in call under way: its module and its inputs, for the step rule (cleared as the call ends)
        self.forward_inputs: tuple[Any, Any, Any] | None = None
        self.told = False
        self._patched: list[tuple[Any, str, Any]] = []
        self._hook: Any = None
        self._fsdp_installed_here = False
        self._fsdp_waiting: WhenImported | None = None
        self.on_hard_exit: Callable[[], None] | None = None  # said after the run is closed by os._exit (dpprof run)
        self._closing: threading.Thread | None = None  # the close hooks of a run --steps stopped, where they run
        self.yields = False  # dpprof run's block, around a whole script: an instrument block of the script's own runs
        self.own_runs: list[str] = []  # the runs the script recorded itself in such a block (ids)

    # the patch
    def patch(self) -> None:
        for kind, names in _NAMES.items():
            if kind != "fully_shard":
                self._patch_names(kind, names)
        _ddp._install_optimizer_hooks()  # DDP's optimizer timing runs before the step ends
        if _FSDP_MODULE in sys.modules:
            self._patch_fsdp()
        else:  # when the script imports it
            self._fsdp_waiting = WhenImported(_FSDP_MODULE, self._patch_fsdp)
            sys.meta_path.insert(0, self._fsdp_waiting)
        self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        if self.record_args is not None:  # before the script's imports: a name it binds is the timed collective
            script_comms.install()
        self._patch_grad_scaler()
        self._patch_process_start()
        self._patch_hard_exit()

    def _patch_hard_exit(self) -> None:
        """os._exit, closing the run first: a script that ends so (to skip gloo's or NCCL's teardown at the
        interpreter's exit) runs no finally block, and its run would be left incomplete without its last steps. Only in
        this process: a forked child (a DataLoader worker) ends with os._exit too, and the run is not its own."""
        original = os._exit
        pid = os.getpid()

        def _exit(status: int) -> Any:
            if os.getpid() == pid:  # an outer block's too (dpprof run's, around the script's own): its run was open
                self.finish(SystemExit(status))
                self.wait_closed()
                if self.on_hard_exit is not None:
                    self.on_hard_exit()
            original(status)

        self._patched.append((os, "_exit", original))
        os._exit = _exit

    def _patch_grad_scaler(self) -> None:
        """GradScaler.step, ending the step where it skips optimizer.step() (inf or NaN gradients: mixed precision's
        first iterations, while the scale is too high), as the optimizer's step would have: else each skipped
        iteration joined the next as if it were gradient accumulation. torch.cuda.amp's and FSDP's scalers inherit it."""
        from torch.amp.grad_scaler import GradScaler

        original = GradScaler.step

        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = self.optimizer_steps
            result = original(scaler, optimizer, *args, **kwargs)
            if self.optimizer_steps == before:  # skipped: no optimizer step hook ran
                self._on_optimizer_step(optimizer, args, kwargs)
            return result

        self._patched.append((GradScaler, "step", original))
        GradScaler.step = step  # type: ignore[method-assign]

    def _patch_process_start(self) -> None:
        """multiprocessing's Process.start, counting the processes the script starts, then starting each as before."""
        import multiprocessing.process

        base = multiprocessing.process.BaseProcess
        original = base.start
        started = self.started_processes

        def start(process: Any) -> None:
            target = getattr(process, "_target", None)
            what = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}".strip(".")
            if what != _DATALOADER_WORKER:
                started.append(what or type(process).__name__)
            original(process)

        self._patched.append((base, "start", original))
        base.start = start  # type: ignore[method-assign]

    def _patch_names(self, kind: str, names: list[tuple[str, str]]) -> None:
        for module_name, attr in names:
            partial = sys.modules.get(module_name)
            if partial is not None and not hasattr(partial, attr):
                # being imported now, its own import having brought in the module patched here (a script's
                # `from torch.distributed._composable.fsdp import fully_shard`): it takes the stand-in from there as it
                # finishes, and unpatch puts torch's back
                continue
            module = importlib.import_module(module_name)
            self._patched.append((module, attr, getattr(module, attr)))
            setattr(module, attr, _STAND_INS[kind])

    def _patch_fsdp(self) -> None:
        """fully_shard's names, and FSDP2's per-step functions wrapped (dpprof.parallel.fsdp)."""
        self._fsdp_waiting = None
        try:
            original = _torch_fully_shard()
            if original is None:  # a torch built without torch.distributed
                return
            functools.update_wrapper(fully_shard, original)
            self._patch_names("fully_shard", _NAMES["fully_shard"])
            self._patch_fsdp1_init()
            self._fsdp_installed_here = not _fsdp.installed()
            _fsdp.install()  # FSDP2's and FSDP1's steps (their hooks do nothing outside a recording)
            if self._hook is not None:  # the step ends after FSDP's optimizer timing: global hooks run in order made
                self._hook.remove()
                self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        except Exception as err:  # a torch whose FSDP moved: the script runs, its FSDP steps unrecorded
            self.say(f"cannot record FSDP ({type(err).__name__}: {err}); its steps run unrecorded")

    def _patch_fsdp1_init(self) -> None:
        """FullyShardedDataParallel (FSDP1) starts the run when it is built, as fully_shard does."""
        try:
            cls = importlib.import_module("torch.distributed.fsdp").FullyShardedDataParallel
        except (ImportError, AttributeError):
            return
        original = cls.__dict__["__init__"]

        @functools.wraps(original)
        def __init__(module: Any, *args: Any, **kwargs: Any) -> None:
            with _building("FullyShardedDataParallel"):
                original(module, *args, **kwargs)
            session = _session
            if session is not None:
                session.built()
                if session.run is not None:  # a job sharded with FSDP1, whichever strategy: NO_SHARD's run is DDP-like
                    session.run.note_workload(fsdp=True)

        self._patched.append((cls, "__init__", original))
        cls.__init__ = __init__

    def unpatch(self) -> None:
        if self._fsdp_waiting is not None:
            self._fsdp_waiting.remove()
            self._fsdp_waiting = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for module, attr, original in reversed(self._patched):
            setattr(module, attr, original)
        self._patched.clear()
        torch_fully_shard = _torch_fully_shard() if _FSDP_MODULE in sys.modules else None
        for module_name, attr in _NAMES["fully_shard"]:  # those that took the stand-in as their import finished
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attr, None) is fully_shard and torch_fully_shard is not None:
                setattr(module, attr, torch_fully_shard)
        if self._fsdp_installed_here:
            _fsdp.uninstall()
            self._fsdp_installed_here = False

    # the run
    def say(self, message: str) -> None:
        """The recording's own trouble, said once on stderr; the script goes on."""
        if not self.told:
            self.told = True
            print(f"dpprof: {message}", file=sys.stderr, flush=True)

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.record_args is None:
            self.stopped = True
            return
        try:
            recording = record(**self.record_args)
            self.run = recording.__enter__()
            self._recording = recording
        except Exception as err:  # an unwritable reports directory, a full disk
            self.run, self.stopped = None, True
            self.say(f"cannot record ({type(err).__name__}: {err}); the script runs unrecorded")
            return
        self.run.joins_open_step = self._joins_open_step
        self.run.forward_ended = self.after_forward
        self.run.forward_starting = self.before_forward

    def finish(self, exc: BaseException | None) -> None:
        """Close the run: finished, unless the script raised (SystemExit 0 is a finish)."""
        if self._recording is None:
            return
        if self.run is not None and not self.optimizer_seen and self.run.steps_started < self.backwards:  # none ended
            self.run.note("dpprof", NO_OPTIMIZER_NOTE.format(self.backwards), tell=False)
        # nothing built, and no step from a dpprof.DataParallel the script made itself: say why the run is empty
        if self.run is not None and not self.built_any and not self.run.steps_started:
            self.run.note("dpprof", _nothing_built(self.started_processes, self.own_runs, self.failed_builds),
                          tell=False)
        recording, self._recording = self._recording, None
        self.forward_inputs = None  # a root forward that raised: its module and batch, not kept past the run
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            exc = None
        try:
            if exc is None:
                recording.__exit__(None, None, None)
            else:
                recording.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as err:
            self.say(f"closing the run failed ({type(err).__name__}: {err})")

    def note_own_run(self, run: Run) -> None:
        """A stored run closed in the block that is not this block's: the script recorded itself (a close hook)."""
        if run is not self.run:
            self.own_runs.append(run.id)

    def stop(self, reason: str) -> None:
        """End recording now; the script goes on unrecorded, not waiting for the run's close hooks (its findings
        computed and stored: 0.2-0.5 s a small run), which run on a thread the block's end waits for (wait_closed)."""
        if self.run is not None:
            self.run.note("dpprof", reason, tell=False)
            self.run.close_hooks_later = self._close_hooks_on_thread
        self.stopped = True
        self.finish(None)

    def _close_hooks_on_thread(self, hooks: Callable[[], None]) -> None:
        def run_hooks() -> None:
            try:
                hooks()
            except Exception as err:  # the run is stored whole; only what a hook adds to it is missing
                self.say(f"closing the run failed ({type(err).__name__}: {err})")

        self._closing = threading.Thread(target=run_hooks, name="dpprof-close-hooks", daemon=True)
        self._closing.start()

    def wait_closed(self) -> None:
        """Wait for the close hooks of a run --steps stopped (stop), where they still run."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.join()

    # what the stand-ins call
    def cpu_workers_for(self, device_ids: Sequence[Any] | None) -> list[torch.device] | None:
        """CPU workers for a DataParallel where torch would pass through: no GPU, and no CPU workers named (no
        device_ids, or GPU ones: torch ignores them where it finds no GPU)."""
        if self.cpu_workers and not torch.cuda.is_available() and not is_cpu_worker_list(device_ids):
            return cpu_devices(self.cpu_workers)
        return None

    def built(self) -> None:
        self.built_any = True
        self.start()

    def before_forward(self, module: Any = None, inputs: Any = None, kwargs: Any = None) -> None:
        """Before a stand-in's forward call of ``module`` on ``inputs`` and ``kwargs``: --steps stops recording where
        the call would start a step."""
        self.forward_inputs = (module, inputs, kwargs)
        run = self.run
        if run is None or self.stopped or self.steps is None:
            return
        if run.steps_started >= self.steps and run.forward_starts_step(module):
            self.stop(f"recording stopped after {self.steps} steps (--steps); the script went on")

    def after_forward(self, output: Any) -> None:
        self.forward_inputs = None  # the call's module and batch: not kept past the forward (a DDP or FSDP root's)
        if self.run is None or self.stopped:
            return
        self.backward_seen = False
        if torch.is_grad_enabled():
            # every output that needs grad: the loss may use any of them ((features, logits), the logits' alone)
            tensors = [t for t in iter_tensors(output) if t.requires_grad]
            if tensors:
                watch_passes(tensors, self._on_backward)

    def _on_backward(self) -> None:
        self.backward_seen = True
        self.backwards += 1

    def _joins_open_step(self, step: Any, module_id: int | None) -> bool:
        """A forward joins the open step when training is under way: a backward since the step's last
        forward (gradient accumulation), or an optimizer that ends steps; never under no_grad, and never a step
        opened under no_grad (an evaluation pass: no optimizer step ends it) by the same module. A forward with grad
        of another module joins a step a no_grad forward opened: a distillation's teacher, then its student (or a
        frozen backbone, then the head trained on its features), one iteration, one step. A step whose forward raised
        and ran no backward (the script caught the error and skipped the batch) is joined by none: it trained nothing
        (queries.raised_steps_of), and the next forward is the next batch's, a step of its own."""
        if not torch.is_grad_enabled() or (step.raised_calls and not step.passes):
            return False
        if step.grad:
            return self.optimizer_seen or self.backward_seen or self._fed_by_graph(module_id)
        return module_id is not None and step.opened_by is not None and module_id != step.opened_by

    def _fed_by_graph(self, module_id: int | None) -> bool:
        """Whether the forward of ``module_id`` under way takes a tensor with autograd history: another model's output
        (a backbone's features into a head, an encoder's into a decoder), part of the same iteration, where an
        evaluation pass with grad on takes its batch from the data."""
        call = self.forward_inputs
        if call is None or module_id is None or id(call[0]) != module_id:
            return False
        return any(t.grad_fn is not None for t in iter_tensors(call[1:]))

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        run = self.run
        if run is None or self.stopped:
            return
        self.optimizer_seen = True
        self.backward_seen = False
        # --steps stops at the forward that would start a step past the limit (before_forward), not here: another
        # optimizer stepped after this one (several optimizers, back to back) is the last step's too
        run.end_step(optimizer)


@contextmanager
def instrumented(record_args: dict[str, Any] | None, cpu_workers: int | None = None,
                 steps: int | None = None, yields: bool = False) -> Iterator[_Session]:
    """The instrument block itself, yielding its session (``session.run`` once started).

    ``record_args`` are ``dpprof.record``'s; None records nothing (the stand-ins and CPU workers only:
    what ``dpprof run --no-record`` runs, to measure what recording costs). ``yields``: the block of ``dpprof run``
    around a whole script, inside which the script's own instrument block runs as under python, into its own run."""
    global _session
    outer = _session
    if outer is not None and not outer.yields:
        raise RuntimeError("dpprof.instrument blocks cannot be nested")
    if cpu_workers is not None and cpu_workers < 1:
        raise ValueError(f"cpu_workers must be positive, got {cpu_workers}")
    if cpu_workers is not None and cpu_workers > MAX_CPU_WORKERS:  # refused here, not at the script's DataParallel
        raise ValueError(f"cpu_workers={cpu_workers:,}: at most {MAX_CPU_WORKERS} CPU workers exist (cpu:0 to "
                         f"cpu:{MAX_DEVICE_INDEX}: torch numbers a device 0 to {MAX_DEVICE_INDEX})")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    session = _Session(record_args, cpu_workers, steps)
    session.yields = yields
    session.patch()
    _session = session
    if yields:
        CLOSE_HOOKS.append(session.note_own_run)
    error: BaseException | None = None
    try:
        if not _under_launcher():
            session.start()
        yield session
    except BaseException as err:
        error = err
        raise
    finally:
        _session = outer
        session.wait_closed()
        if yields:
            CLOSE_HOOKS.remove(session.note_own_run)
        session.unpatch()
        if not session.stopped:
            session.start()  # a script that built nothing still gets its run, and a note saying so (finish)
            session.finish(error)


def _nothing_built(started: list[str], own_runs: Sequence[str] = (), failed: Sequence[str] = ()) -> str:
    """Why a run recorded nothing: the script built nothing, recorded itself, built it in processes of its own, or
    what it built raised."""
    if own_runs:
        return OWN_RUN_NOTE.format(", ".join(own_runs))
    if failed:
        return FAILED_BUILD_NOTE.format(" and ".join(dict.fromkeys(failed)))
    if not started:
        return NO_PARALLEL_NOTE
    spawn = [w for w in started if w.startswith("torch.multiprocessing.spawn.")]
    what = "torch.multiprocessing.spawn" if len(spawn) == len(started) else "multiprocessing"
    return SPAWNED_NOTE.format(f"{len(started):,} process{'' if len(started) == 1 else 'es'}", what)


@contextmanager
def instrument(name: str | None = None, reports_dir: str | os.PathLike[str] | None = None,
               cpu_workers: int | None = None, steps: int | None = None, sync_timing: bool = False,
               workload: str | None = None, workload_args: dict[str, Any] | None = None, store: bool = True,
               sample_hz: float | None = DEFAULT_SAMPLE_HZ, sample_gpus: bool | None = None,
               detail: str = "bounded", capture: str | None = None) -> Iterator[Run | None]:
    """Record every DataParallel, DDP and FSDP2 (fully_shard) that code inside the block builds with torch's own names.

    Args:
        name: a name for the run (default: its id).
        reports_dir: where the run file goes (default: $DPPROF_REPORTS, else ./reports).
        cpu_workers: a DataParallel built with no device_ids on a machine with no GPU runs on this
            many CPU workers instead of torch's pass-through (default: torch's behaviour).
        steps: stop recording after this many steps; the code goes on, unrecorded.
        sync_timing, workload, workload_args, store, sample_hz, sample_gpus, detail, capture: as for
            ``dpprof.record`` (a step ends at each optimizer.step()).

    Returns:
        the run, or None when it could not start (said once on stderr) or, in one of several
        torchrun ranks whose process group is not up yet, starts later: at the first DataParallel
        or DDP built (every rank's records then go into one run, as ``dpprof.record`` does).

    Example:
        >>> with dpprof.instrument(name="notebook") as run:
        ...     model = torch.nn.DataParallel(net)      # dpprof's, recording
        ...     train(model)
        >>> run.frames()["steps"]
    """
    record_args = dict(name=name, reports_dir=reports_dir, sync_timing=sync_timing, workload=workload,
                       workload_args=workload_args, store=store, sample_hz=sample_hz, sample_gpus=sample_gpus,
                       detail=detail, capture=parse_capture(capture))
    with instrumented(record_args, cpu_workers, steps) as session:
        yield session.run
