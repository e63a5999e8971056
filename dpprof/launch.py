"""One description of a profile to start: what ``dpprof profile`` trains, on what, for how long, and under which
run id; used by the CLI, the dashboard's New run page, the advisor's commands, ``dpprof advise --check`` and the
calibration.

A :class:`Profile` validates itself when made (a bad field is a :class:`ProfileError` in one line, the CLI's own
wording), renders itself as the arguments of ``python -m dpprof`` (:meth:`Profile.argv`) and as the shell command
shown to users (:meth:`Profile.command`), and starts: in this process (:meth:`Profile.record`), as a child
process (:meth:`Profile.start`, :meth:`Profile.run_child`), or under torchrun for DDP. The run id is chosen before
the start (:meth:`Profile.with_run_id`) and handed down (``--run-id``), so nothing reads it out of printed text
and nothing lists the runs to find a process's run.

Importing this module loads no torch: the advisor and the dashboard describe profiles without it.

Example:
    >>> p = Profile(workload="tutorial-linear", devices="cpu:2", steps=5, env={"OMP_NUM_THREADS": "1"})
    >>> p.command()
    'OMP_NUM_THREADS=1 dpprof profile tutorial-linear --devices cpu:2 --steps 5'
"""
from __future__ import annotations

import collections
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dpprof.capture.window import CaptureError, parse_capture
from dpprof.plaintext import error_line
from dpprof.processes import LaunchError, Started
from dpprof.store.ids import new_run_id
from dpprof.workload_names import WORKLOAD_NAMES, WORKLOAD_SAMPLES

if TYPE_CHECKING:
    import argparse

    from dpprof.recording import Run

__all__ = [
    "DEFAULT_DEVICES",
    "DEFAULT_WORKLOAD",
    "DETAIL_CHOICES",
    "LaunchError",
    "Profile",
    "ProfileError",
    "check_input_shape",
    "parse_devices",
    "parse_input_shape",
]

DEFAULT_WORKLOAD = "cifar-lenet"
DEFAULT_DEVICES = "cpu:2"
DEFAULT_NPROC = 2  # ranks under --ddp, as dpprof profile's --nproc
_NPROC_ALONE = ("--nproc {} starts ranks with --ddp or --fsdp only: without either the profile is one process "
                "training on --devices (add --ddp or --fsdp, or leave --nproc out)")
DETAIL_CHOICES = ("bounded", "all")  # dpprof.store.retention.DETAIL_MODES, named here without the store's import
# A run id names its file (<id>.sqlite, <id>.rank<N>.sqlite): no dot, no slash, no space; dpprof's own ids
# (20261126-020052-3fa9c1) are 22 characters.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CPU_LIST = re.compile(r"cpu:\d+(,cpu:\d+)+")  # cpu:0,cpu:1: the workers by name, as `dpprof check` takes them
DDP_OMP_THREADS = "1"  # each rank's intra-op threads under torchrun, where the environment sets none
_TAIL_LINES = 30  # a failed child's last lines kept, for the one message that says why


class ProfileError(ValueError):
    """A profile that cannot be started as described (a usage error: the CLI exits 2 with it)."""


def parse_input_shape(text: str) -> tuple[int, ...]:
    """--input-shape: positive sizes separated by commas (or x): 3,224,224 or 3x224x224."""
    parts = [p.strip() for p in re.split(r"[,x]", text.strip())]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ProfileError(f"{text!r} is not a shape of positive sizes like 3,224,224")
    return tuple(int(p) for p in parts)


def parse_devices(text: str) -> list:
    """--devices: "cpu:N" (N CPU workers), "cpu:0,cpu:1" (those workers), "cuda" (every GPU) or "0,1,2"
    (those GPUs)."""
    import torch

    import dpprof
    from dpprof.device_ids import MAX_CPU_WORKERS, MAX_DEVICE_INDEX

    text = text.strip()
    if _CPU_LIST.fullmatch(text.replace(" ", "")):
        return [p.strip() for p in text.split(",")]
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise ProfileError(f"--devices {text!r}: cpu:N needs a positive number of workers")
        if int(count) > MAX_CPU_WORKERS:
            raise ProfileError(f"--devices {text!r}: {int(count):,} CPU workers asked, at most {MAX_CPU_WORKERS} "
                               f"exist (cpu:0 to cpu:{MAX_DEVICE_INDEX}: torch numbers a device 0 to "
                               f"{MAX_DEVICE_INDEX})")
        return dpprof.cpu_devices(int(count))
    if text == "cuda":
        if not torch.cuda.is_available():
            raise ProfileError("--devices cuda: no CUDA GPU is visible here; use cpu:N for CPU workers")
        return list(range(torch.cuda.device_count()))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ProfileError(f"--devices {text!r}: expected cpu:N, cuda, or GPU indices like 0,1,2")
    return [int(p) for p in parts]


def check_input_shape(workload: object, spec: str, shape: Sequence[int]) -> None:
    """One forward pass of the user's model on a batch of two samples of ``shape``, before any run is created:
    a model that cannot take the shape is a ProfileError, said in one line with what it was given (--model's inputs
    are one tensor: a forward of several arguments, or of a dict, fails on it)."""
    from dpprof.workloads import random_inputs, token_count

    model = workload.model  # type: ignore[attr-defined]
    if not any(p.requires_grad for p in model.parameters()):
        raise ProfileError(f"--model {spec} has no parameter that takes a gradient: nothing to train")
    training = model.training
    try:
        model.eval()  # no BatchNorm statistics learnt from the check's random batch
        output = model(random_inputs((2, *shape), token_count(model)))
        loss = workload.criterion(output, None)  # type: ignore[attr-defined]  # the mean square
        loss.backward()  # an output that needs no gradient fails here, not in the run
    except Exception as err:  # noqa: BLE001 - whatever the model raises: the message is what the user needs
        raise ProfileError(f"--model {spec} fails on --input-shape {','.join(map(str, shape))} "
                           f"(a batch of 2, one tensor of shape {tuple([2, *shape])} as its forward's only argument, "
                           f"one training step): {error_line(err)}") from None
    finally:
        model.train(training)
        model.zero_grad(set_to_none=True)  # the check's gradients are not the run's


def _option(flag: str, value: str) -> list[str]:
    """An option and its free-text value: ``--flag=value`` where the value starts with '-' (argparse would take
    ``--flag -x`` for two options), else ``--flag value``."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


@dataclass(frozen=True)
class Profile:
    """A profile to start: ``dpprof profile``'s arguments as fields, checked when made.

    Attributes:
        workload: a built-in workload (dpprof.workload_names); None: --model's, or DEFAULT_WORKLOAD.
        model: ``pkg.module:factory`` of the user's model (with ``input_shape``, one sample's shape).
        devices: --devices as written (cpu:N, cpu:0,cpu:1, cuda, 0,1); None: DEFAULT_DEVICES, not written out.
        batch_size: the global batch (each rank's under ``ddp``); None: the workload's own.
        steps: training steps recorded.
        balanced: DataParallelModel + DataParallelCriterion.
        ddp: under torchrun with dpprof.DistributedDataParallel, ``nproc`` ranks.
        fsdp: under torchrun with FSDP2 (``fully_shard`` on each top-level child module and the root, recorded by
            dpprof.parallel.fsdp), ``nproc`` ranks.
        bucket_cap_mb: under ``ddp``, DDP's bucket_cap_mb (None: torch's 25).
        detail: "bounded" or "all" (dpprof.record's detail).
        name: the run's name (None: the workload's).
        run_id: the run's id, chosen before the start (with_run_id); None: chosen by the recording.
        reports_dir: where the run goes (None: $DPPROF_REPORTS, else ./reports).
        capture: "A:B": steps A to B-1 profiled with torch.profiler (dpprof.record's capture); None: none.
        env: environment set for the process that trains (OMP_NUM_THREADS=1): a profile with any runs in a
            child process, and its shell command sets them first.
    """

    workload: str | None = None
    model: str | None = None
    input_shape: tuple[int, ...] | None = None
    devices: str | None = None
    batch_size: int | None = None
    steps: int = 50
    balanced: bool = False
    ddp: bool = False
    fsdp: bool = False
    nproc: int = DEFAULT_NPROC
    bucket_cap_mb: float | None = None
    detail: str = "bounded"
    name: str | None = None
    run_id: str | None = None
    reports_dir: str | None = None
    capture: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_shape is not None and not isinstance(self.input_shape, tuple):
            object.__setattr__(self, "input_shape", tuple(self.input_shape))
        if self.reports_dir is not None and not isinstance(self.reports_dir, str):
            object.__setattr__(self, "reports_dir", os.fspath(self.reports_dir))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})
        self._validate()

    def _validate(self) -> None:
        """The CLI's checks, in its order and words (ProfileError)."""
        if self.steps < 1:
            raise ProfileError(f"--steps must be positive, got {self.steps}")
        if self.model and self.workload:
            raise ProfileError(f"give a built-in workload ({self.workload}) or --model, not both")
        if self.workload is not None and self.workload not in WORKLOAD_NAMES:
            raise ProfileError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
        if self.ddp and self.fsdp:
            raise ProfileError("give --ddp or --fsdp, not both")
        if self.ddp and self.balanced:
            raise ProfileError("--ddp computes each rank's loss on its own outputs already: no --balanced")
        if self.fsdp and self.balanced:
            raise ProfileError("--fsdp computes each rank's loss on its own outputs already: no --balanced")
        if self.distributed and self.nproc < 1:
            raise ProfileError(f"--nproc must be positive, got {self.nproc}")
        if not self.distributed and self.nproc != DEFAULT_NPROC:
            raise ProfileError(_NPROC_ALONE.format(self.nproc))
        if self.bucket_cap_mb is not None and not self.ddp:
            raise ProfileError("--bucket-cap-mb is DDP's gradient bucket size: give it with --ddp")
        if self.bucket_cap_mb is not None and not (0 < self.bucket_cap_mb < float("inf")):
            raise ProfileError(f"--bucket-cap-mb must be a positive number of MB, got {self.bucket_cap_mb:g}")
        if self.model and not self.input_shape:
            raise ProfileError("--model needs --input-shape (the shape of one sample, e.g. 3,224,224)")
        if self.input_shape is not None and not self.model:  # a built-in makes its own inputs: never dropped unsaid
            raise ProfileError(f"--input-shape is the shape of --model's inputs; the built-in workload "
                               f"({self.workload or DEFAULT_WORKLOAD}) makes its own: give --model, or leave it out")
        if self.input_shape is not None and (not self.input_shape or any(d < 1 for d in self.input_shape)):
            raise ProfileError(f"--input-shape {self.input_shape}: sizes must be positive")
        if self.batch_size is not None and self.batch_size < 1:
            raise ProfileError(f"batch size must be positive, got {self.batch_size}")
        most = WORKLOAD_SAMPLES.get(self.workload_name)
        if most is not None and self.batch_size is not None and self.batch_size > most:
            # its loader would yield every sample as one batch: a run of another batch than asked for
            raise ProfileError(f"{self.workload_name}'s data set holds {most} samples: --batch-size takes 1 to "
                               f"{most}" + (" (each rank's)" if self.distributed else "") + f", got {self.batch_size:,}")
        if self.detail not in DETAIL_CHOICES:
            raise ProfileError(f"--detail {self.detail!r}: choose one of {', '.join(DETAIL_CHOICES)}")
        if self.devices is not None and not self.devices.strip():
            raise ProfileError("--devices is empty: give cpu:N, cuda, or GPU indices like 0,1,2")
        if self.run_id is not None and not _RUN_ID.fullmatch(self.run_id):
            raise ProfileError(f"--run-id {self.run_id!r}: a run id is 1 to 64 letters, digits, '-' and '_', "
                               "starting with a letter or digit")
        if self.capture is not None:
            try:
                window = parse_capture(self.capture)
            except CaptureError as err:
                raise ProfileError(f"--capture {self.capture}: {err.reason}") from None
            assert window is not None
            if window.end_step > self.steps:
                raise ProfileError(f"--capture {self.capture}: the profile runs {self.steps} steps (0 to "
                                   f"{self.steps - 1}); the window must end by {self.steps}")
        bad = [k for k in self.env if not _ENV_NAME.fullmatch(k)]
        if bad:
            raise ProfileError(f"environment variable name {bad[0]!r} is not a name like OMP_NUM_THREADS")

    # -- what it is --------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        """Whether this profile runs under torchrun (--ddp or --fsdp)."""
        return self.ddp or self.fsdp

    @property
    def workload_name(self) -> str:
        """The built-in workload trained, or the model's factory."""
        return self.model or self.workload or DEFAULT_WORKLOAD

    @property
    def devices_text(self) -> str:
        """--devices as it applies (DEFAULT_DEVICES where none is given)."""
        return self.devices or DEFAULT_DEVICES

    def with_run_id(self) -> Profile:
        """This profile with its run id chosen (a new one where it has none)."""
        return self if self.run_id else replace(self, run_id=new_run_id())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Profile:
        """The profile ``dpprof profile``'s parsed arguments describe (the inverse of argv)."""
        shape = args.input_shape
        if args.nproc is not None and not (args.ddp or getattr(args, "fsdp", False)):
            raise ProfileError(_NPROC_ALONE.format(args.nproc))
        return cls(workload=args.workload, model=args.model, input_shape=tuple(shape) if shape else None,
                   devices=args.devices, batch_size=args.batch_size, steps=args.steps, balanced=args.balanced,
                   ddp=args.ddp, fsdp=getattr(args, "fsdp", False),
                   nproc=DEFAULT_NPROC if args.nproc is None else args.nproc,
                   bucket_cap_mb=getattr(args, "bucket_cap_mb", None), detail=args.detail,
                   name=args.name, run_id=args.run_id, reports_dir=args.reports_dir, capture=args.capture)

    # -- as words ----------------------------------------------------------------------------------

    def argv(self, quiet: bool = False) -> list[str]:
        """The arguments of ``python -m dpprof`` (``dpprof``) that start this profile (env aside)."""
        out = _option("--reports-dir", self.reports_dir) if self.reports_dir is not None else []
        out.append("profile")
        if self.model:
            out += [*_option("--model", self.model), "--input-shape", ",".join(map(str, self.input_shape or ()))]
        elif self.workload:
            out.append(self.workload)
        if self.ddp:
            out.append("--ddp")
        if self.fsdp:
            out.append("--fsdp")
        if self.distributed:
            out += ["--nproc", str(self.nproc)]
        if self.bucket_cap_mb is not None:
            out += ["--bucket-cap-mb", repr(float(self.bucket_cap_mb))]  # repr: the float itself, back from argv
        if self.devices is not None:
            out += _option("--devices", self.devices)
        if self.batch_size is not None:
            out += ["--batch-size", str(self.batch_size)]
        if self.balanced:
            out.append("--balanced")
        out += ["--steps", str(self.steps)]
        if self.detail != "bounded":
            out += ["--detail", self.detail]
        if self.name is not None:
            out += _option("--name", self.name)
        if self.run_id is not None:
            out += ["--run-id", self.run_id]
        if self.capture is not None:
            out += ["--capture", self.capture]
        if quiet:
            out.append("--quiet")
        return out

    def command(self) -> str:
        """The shell command a user types to start this profile: ``[VAR=value ...] dpprof profile ...``."""
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        return prefix + shlex.join(["dpprof", *self.argv()])

    def child_argv(self, quiet: bool = True) -> list[str]:
        """The child process's command line: this interpreter running ``-m dpprof`` with argv()."""
        return [sys.executable, "-m", "dpprof", *self.argv(quiet=quiet)]

    # -- starting it -------------------------------------------------------------------------------

    def start(self, log: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
              new_session: bool = False) -> Started:
        """Start ``python -m dpprof profile`` in a child process, its run id chosen first; returns at once.

        Args:
            log: a file for the child's output (stdout and stderr); None: kept in memory, read at wait().
            env: more environment for the child, over the profile's own (not shown in its command).
            new_session: the child in a session of its own (not ended with its parent's terminal or page).
        """
    
        return Started.launch(self.with_run_id(), log=log, env=env, new_session=new_session)

    def run_child(self, timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> str:
        """Start the profile in a child process and wait for it; returns its run id.

        Raises:
            LaunchError: it exited with an error (the message ends with its last lines).
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed first).
        """
        started = self.start(env=env)
        started.wait(timeout_s)
        started.raise_for_status()
        return started.run_id

    def run(self, progress: Callable[[Iterator[int]], Iterator[int]] | None = None) -> str:
        """Start the profile and wait for it; returns its run id. In this process where it can be (no DDP, no
        env), else as a child (torchrun's ranks for DDP).

        Raises:
            ProfileError: the profile cannot start as described.
            LaunchError: a child failed, or the recording did (what was recorded is kept).
        """
        profile = self.with_run_id()
        if profile.distributed:
            profile.run_ddp()
            return str(profile.run_id)
        if profile.env:
            return profile.run_child()
        run = profile.record(progress)
        if run.recording_failed:
            raise LaunchError(f"the recording of run {run.id} failed", 1)
        return run.id

    def record(self, progress: Callable[[Iterator[int]], Iterator[int]] | None = None) -> Run:
        """Train and record this (non-DDP) profile in this process; returns the run (its recording_failed says
        whether everything was recorded). ``progress`` wraps the step iterator (a tqdm bar).

        Raises:
            ProfileError: devices, model or shape that cannot be used.
        """
        from dpprof.device_ids import resolve_devices
        from dpprof.workloads import build_workload, train, user_workload

        if self.distributed:
            raise ProfileError("a --ddp or --fsdp profile runs under torchrun: use run() or run_ddp()")
        self._check_id_free()
        self._model_importable()
        devices = parse_devices(self.devices_text)
        try:
            resolve_devices(devices)
            if self.model:
                workload = user_workload(self.model, list(self.input_shape or ()), self.batch_size)
                check_input_shape(workload, self.model, list(self.input_shape or ()))
            else:
                workload = build_workload(self.workload or DEFAULT_WORKLOAD, self.batch_size)
        except ValueError as err:
            raise ProfileError(str(err)) from None
        return train(workload, devices, self.steps, name=self.name, reports_dir=self.reports_dir, progress=progress,
                     balanced=self.balanced, detail=self.detail, run_id=self.run_id, capture=self.capture)

    def _check_id_free(self) -> None:
        """A run id given that a run in the reports directory has already: one line, before anything starts
        (the store's atomic publish would refuse it too, less clearly; the run that has it is never touched)."""
        if self.run_id is None:
            return
        from dpprof.store.reader import RUN_SUFFIX, reports_dir

        directory = reports_dir(self.reports_dir)
        taken = sorted([*directory.glob(f"{self.run_id}{RUN_SUFFIX}"),
                        *directory.glob(f"{self.run_id}.rank*{RUN_SUFFIX}")])
        if taken:
            raise ProfileError(f"--run-id {self.run_id}: {directory} holds a run of that id already ({taken[0].name}); "
                               "give another id, or none for a new one")

    def _model_importable(self) -> None:
        """--model pkg.module:factory from the current directory, as python -m finds it."""
        if self.model and os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())

    def ddp_argv(self, on_gpus: bool = False) -> list[str]:
        """torchrun's command line for this DDP profile: one dpprof.ddp_worker per rank (each on a GPU where
        ``on_gpus``)."""
        what = (["--model", str(self.model), "--input-shape", ",".join(map(str, self.input_shape or ()))]
                if self.model else [self.workload or DEFAULT_WORKLOAD])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
               "-m", "dpprof.ddp_worker", *what, "--steps", str(self.steps),
               "--device", "cuda" if on_gpus else "cpu", "--detail", self.detail, *(["--fsdp"] if self.fsdp else [])]
        for flag, value in (("--batch-size", self.batch_size), ("--name", self.name),
                            ("--reports-dir", self.reports_dir), ("--run-id", self.run_id),
                            ("--capture", self.capture), ("--bucket-cap-mb", self.bucket_cap_mb)):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd

    def run_ddp(self, on_step: Callable[[], None] | None = None) -> str:
        """Run this DDP profile under torchrun, one process per rank, and wait; returns its run id.
        ``on_step`` is called at each of rank 0's steps (a progress bar).

        Raises:
            ProfileError: the devices or the user's model cannot be used (checked before torchrun starts).
            LaunchError: torchrun failed; its lines are the ranks' one-line reasons, else torchrun's last lines.
        """
        from dpprof.ddp_worker import FAILED_PREFIX, STEP_PREFIX
        from dpprof.device_ids import is_cpu_worker_list

        if not self.distributed:
            raise ProfileError("not a --ddp or --fsdp profile: use record() or run()")
        profile = self.with_run_id()
        profile._check_id_free()
        if profile.model:  # the shape checked here, in one line, before torchrun starts any rank
            from dpprof.workloads import user_workload

            profile._model_importable()
            shape = list(profile.input_shape or ())
            try:
                check_input_shape(user_workload(profile.model, shape, 2), profile.model, shape)
            except ValueError as err:
                raise ProfileError(str(err)) from None
        on_gpus = not is_cpu_worker_list(parse_devices(profile.devices_text))  # cuda or 0,1: each rank on a GPU
        cmd = profile.ddp_argv(on_gpus)
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        said: list[str] = []  # ranks' one-line reasons for stopping
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", DDP_OMP_THREADS), **profile.env}
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip())
                if FAILED_PREFIX in line:  # a rank's reason; another process's partial write may precede it
                    said += [FAILED_PREFIX + part.rstrip() for part in line.split(FAILED_PREFIX)[1:]]
                elif on_step is not None:
                    # each rank writes its lines whole, but another process's partial write (torchrun's log, a
                    # rank's warning) can put rank 0's line after it on the same line: counted wherever it is
                    for _ in range(line.count(STEP_PREFIX)):
                        on_step()
        if proc.returncode != 0:
            # a rank that said why it stopped is the cause; torchrun's own report of it is noise
            lines = sorted(said) if said else list(tail)
            raise LaunchError(f"torchrun exited with {proc.returncode}", proc.returncode, lines)
        return str(profile.run_id)

