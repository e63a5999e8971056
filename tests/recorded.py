"""Runs the CPU backend really records, for the dashboard's tests (queries, views, charts, app, browser), and a
recording child process killed mid-run, for the crash tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import forked
import pandas as pd
import torch
from torch import nn

import dpprof
from dpprof.store.reader import StoredRun
from dpprof.workloads import build_workload, train

BUS = ["00000000:1A:00.0", "00000000:3B:00.0"]


def record(directory: Path, name: str, workers: int = 2, steps: int = 6, batch_size: int = 32,
           balanced: bool = False, workload: str = "cifar-lenet") -> StoredRun:
    """Train a built-in workload on CPU workers for a few steps, recorded into ``directory``."""
    run = train(build_workload(workload, batch_size), dpprof.cpu_devices(workers), steps, name=name,
                reports_dir=str(directory), balanced=balanced)
    return dpprof.load_run(run.path)


def record_with_gpu_samples(directory: Path, steps: int = 6, detail: object = "bounded") -> StoredRun:
    """A CPU-worker run while the fake NVML (tests/fake_pynvml.py, installed by the fake_gpus fixture)
    reports two GPUs: the recorder's own sampler, asked to sample from the start, stores their samples."""
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="sampled", reports_dir=str(directory), sample_hz=50.0, sample_gpus=True,
                       detail=detail) as run:
        for _ in range(steps):
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
            time.sleep(0.05)
    return dpprof.load_run(run.path)


class RunningRun:
    """A run left recording in a background thread until stop(): its status reads 'running'."""

    def __init__(self, directory: Path, name: str = "live", workers: int = 2, capture: str | None = None) -> None:
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.steps = 0
        self.path: str | None = None
        self.run: dpprof.Run | None = None
        self._thread = threading.Thread(target=self._train, args=(directory, name, workers, capture), daemon=True)

    def _train(self, directory: Path, name: str, workers: int, capture: str | None) -> None:
        torch.manual_seed(0)
        net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(workers))
        with dpprof.record(name=name, reports_dir=str(directory), capture=capture) as run:
            self.path, self.run = run.path, run
            while not self._stop.is_set():
                with run.step():
                    net(torch.randn(8, 5)).sum().backward()
                self.steps += 1
                if self.steps >= 5:
                    self._ready.set()
                time.sleep(0.02)

    def __enter__(self) -> RunningRun:
        self._thread.start()
        assert self._ready.wait(30), "the background run never recorded 5 steps"
        time.sleep(0.6)  # the writer commits every 0.5 s: the first steps are on disk
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class _FailsOnSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls:  # in every replica of the second step
            raise ValueError("shape mismatch in the second step")
        return self.linear(x)


def record_failed(directory: Path, name: str = "failed") -> StoredRun:
    """A run that fails in its second step inside a replica (torch's "Caught ... in replica" traceback text),
    leaving two recorded steps (the failing one too): the status is failed."""
    model = _FailsOnSecondCall()
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    try:
        with dpprof.record(name=name, reports_dir=str(directory)) as run:
            for _ in range(2):
                with run.step():
                    net(torch.randn(8, 5)).sum().backward()
                model.calls += 1
    except ValueError:
        pass
    return dpprof.load_run(run.path)


def record_failed_before_a_step(directory: Path, name: str = "failed early") -> StoredRun:
    """A run whose code raises before its first step: failed, with no steps recorded."""
    try:
        with dpprof.record(name=name, reports_dir=str(directory)) as run:
            raise ValueError("the data set is missing")
    except ValueError:
        pass
    return dpprof.load_run(run.path)


class _OutOfMemoryWhenFlagged(nn.Module):
    """A linear layer whose forward, while ``fail`` is set, takes ``sleep_s`` and raises torch's out-of-memory error
    (in each replica: torch re-raises the first in the caller)."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.sleep_s = sleep_s
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            time.sleep(self.sleep_s)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)


def record_skipped_batches(directory: Path, kinds: str, detail: object = "bounded", sleep_s: float = 0.02) -> str:
    """A DataParallel run on 2 CPU workers, one implicit step per letter of ``kinds``: "T" trains on 32 samples, "E"
    evaluates 64 under no_grad, "R" is a forward of 32 that raises out of memory after ``sleep_s``, which the script
    catches and skips the batch (zero_grad, go on), as training loops do. Returns the run's path."""
    torch.manual_seed(0)
    model = _OutOfMemoryWhenFlagged(sleep_s)
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    with dpprof.record(name="skipped batches", reports_dir=str(directory), sample_hz=None, detail=detail) as run:
        for kind in kinds:
            model.fail = kind == "R"
            if kind == "E":
                with torch.no_grad():
                    net(torch.randn(64, 8))
                continue
            try:
                net(torch.randn(32, 8)).sum().backward()
                optimizer.step()
            except torch.OutOfMemoryError:
                pass
            optimizer.zero_grad()
    assert run.path is not None
    return run.path


def record_thinned_evaluation(directory: Path, detail: object, iterations: int, evaluations: Callable[[int], int],
                              stall_at: set[int], step_s: float, stall_s: float, name: str
                              ) -> tuple[StoredRun, list[int]]:
    """A DataParallel run of a Linear(16, 4) on 2 CPU workers, its detail kept by ``detail`` (a small Retention thins
    it): ``iterations`` training steps (``run.step()``: a forward of 32 samples, backward, a sleep of ``step_s``, or
    ``stall_s`` at the iterations in ``stall_at``), each followed by ``evaluations(i)`` evaluation steps (a no_grad
    forward, its own step). Returns the stored run and its training steps' indexes, in order."""
    torch.manual_seed(0)
    net = dpprof.DataParallel(torch.nn.Linear(16, 4), device_ids=dpprof.cpu_devices(2))
    training = []
    with dpprof.record(name=name, reports_dir=str(directory), detail=detail, sample_hz=None) as run:
        for i in range(iterations):
            with run.step() as index:
                net(torch.randn(32, 16)).sum().backward()
                time.sleep(stall_s if i in stall_at else step_s)
            training.append(index)
            for _ in range(evaluations(i)):
                with run.step(), torch.no_grad():
                    net(torch.randn(32, 16))
    assert run.path is not None
    return dpprof.load_run(run.path), training


STALL_S = 0.3  # a stalled step: at least this, and 3x the median step so far (a loaded machine's steps grow)


class _Flagged(nn.Module):
    """A small MLP whose forward sleeps on a chunk flagged in its first column: the device given it straggles."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.sleep_s = sleep_s
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x[0, 0]) > 0.5:
            time.sleep(self.sleep_s)
        return self.net(x)


def record_straggler(directory: Path | None, steps: int, detail: object = "bounded", stall_steps: tuple[int, ...] = (),
                     name: str = "straggler", sleep_s: float = 0.002, pause_s: float = 0.0):
    """A run on 2 CPU workers whose cpu:0 sleeps ``sleep_s`` in every apply (a straggler by construction), with
    ``stall_steps`` stalled STALL_S more and every step ``pause_s`` longer after its backward (outside the work);
    ``directory`` None keeps it in memory. Returns the closed Run."""
    torch.manual_seed(0)
    net = dpprof.DataParallel(_Flagged(sleep_s), device_ids=dpprof.cpu_devices(2))
    x = torch.randn(16, 8)
    x[:, 0] = 0.0
    x[:8, 0] = 1.0  # torch.chunk gives cpu:0 the first 8 rows: the flagged chunk
    with dpprof.record(name=name, reports_dir=str(directory) if directory else None, detail=detail,
                       store=directory is not None) as run:
        took: list[float] = []
        for i in range(steps):
            t0 = time.perf_counter()
            with run.step():
                net(x).sum().backward()
                if pause_s:
                    time.sleep(pause_s)
                if i in stall_steps:  # over twice the median step however loaded the machine is
                    time.sleep(max(STALL_S, 3 * statistics.median(took or [0.0])))
            took.append(time.perf_counter() - t0)
    return run


def killed_child(setup: str = "", record_args: str = "", pause_s: float = 0.01) -> str:
    """A script for ``python -c``: ``setup``, then a step of a Linear on 2 CPU workers recorded in a loop
    (``dpprof.record(name="killed"{record_args})``) until the process is killed. It prints its run's path, then
    each step's number once the step is done."""
    return f"""
import os, sys, time, torch, dpprof
{setup}
net = dpprof.DataParallel(torch.nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
with dpprof.record(name="killed"{record_args}) as run:
    print(run.path, flush=True)
    i = 0
    while True:
        with run.step():
            net(torch.randn(8, 5)).sum().backward()
        print(i, flush=True)
        i += 1
        time.sleep({pause_s})
"""


def record_until_killed(script: str, step: int, env: dict[str, str]) -> tuple[str, int, str, int]:
    """Run ``script`` (killed_child's) with ``env`` added to this process's, read its first line, wait until it has
    done step ``step`` and two commit intervals more (so that step is on disk), then SIGKILL it.

    Returns:
        (its first line, the last step it printed, its stderr, its exit code)
    """
    child = forked.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, **env})
    try:
        first = child.stdout.readline().strip()
        last = -1
        while last < step:
            last = int(child.stdout.readline())
        time.sleep(1.5)  # > 2 commit intervals: step `last` is on disk
    finally:
        child.kill()
        _, err = child.communicate(timeout=60)
    return first, last, err, child.returncode


class ProfiledOnce:
    """``dpprof profile`` runs recorded once per test session and copied into each reports directory that asks.

    Recording a DDP run starts torchrun and two ranks (several seconds); modules that read the same run (the same
    ``profile`` arguments) share one recording, across pytest-xdist's workers too: ``cache`` is a directory they
    share, and a lock file per recording makes the first worker that asks record it while the others wait for it.
    The run's files (one per rank) are copied, so a test that changes its directory's copy changes no other's.
    """

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.cache.mkdir(parents=True, exist_ok=True)

    def __call__(self, directory: Path, *argv: str) -> list[str]:
        """``dpprof --reports-dir directory profile *argv --quiet``, recorded on the first call with these ``argv``
        and copied into ``directory`` on every call. Returns the names of the run's files copied."""
        import fcntl
        import hashlib

        from dpprof.cli import main

        key = hashlib.sha1("\0".join(argv).encode()).hexdigest()[:16]
        where, done = self.cache / f"profile-{key}", self.cache / f"profile-{key}.done"
        with open(self.cache / f"profile-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker recording it: wait for its files
            if not done.exists():
                shutil.rmtree(where, ignore_errors=True)  # a worker that failed here left a part
                where.mkdir()
                assert main(["--reports-dir", str(where), "profile", *argv, "--quiet"]) == 0, argv
                done.touch()
        files = sorted(p for p in where.iterdir() if p.is_file())
        assert files, f"dpprof profile {' '.join(argv)} left no run file"
        Path(directory).mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.copy2(path, Path(directory) / path.name)
        return [p.name for p in files]


def train_gan(generator: nn.Module, discriminator: nn.Module, iterations: int = 3) -> None:
    """A GAN's iterations on 6 samples, its steps ended by its two optimizers: the generator's forward in the
    discriminator's step, its backward (through the discriminator) in the generator's step after."""
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (generator, discriminator))
    for _ in range(iterations):
        fake = generator(torch.randn(6, 4))
        d_loss = discriminator(torch.randn(6, 8)).mean() - discriminator(fake.detach()).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = -discriminator(fake).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()


def train_distillation(teacher: nn.Module, student: nn.Module, iterations: int = 3, evaluations: int = 2) -> None:
    """Knowledge distillation on 6 samples of 4 features: ``iterations`` of the teacher under no_grad, then the student
    with grad, its backward and optimizer step; then ``evaluations`` forward calls of the student under no_grad, and
    one iteration more."""
    opt = torch.optim.SGD(student.parameters(), lr=0.01)

    def iteration() -> None:
        x = torch.randn(6, 4)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(student(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(iterations):
        iteration()
    with torch.no_grad():
        for _ in range(evaluations):
            student(torch.randn(6, 4))
    iteration()


class _Wrapping(torch.optim.Optimizer):
    """An optimizer that steps another inside its own step, then does work of its own (ZeroRedundancyOptimizer's
    broadcast of the updated shards, a Lookahead's slow weights): here a sleep of ``own_s``."""

    def __init__(self, inner: torch.optim.Optimizer, own_s: float) -> None:
        self.inner, self.own_s = inner, own_s
        super().__init__(inner.param_groups, {})

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.inner.step()
        time.sleep(self.own_s)


def train_with_a_wrapping_optimizer(model: nn.Module, steps: int = 3, own_s: float = 0.02) -> list[float]:
    """``steps`` steps of ``model`` on 8 samples of 4 features, its optimizer an SGD inside a wrapping optimizer whose
    own work after it takes ``own_s``; the ms each ``optimizer.step()`` took, as the script times it."""
    opt = _Wrapping(torch.optim.SGD(model.parameters(), lr=0.1), own_s)
    took = []
    for _ in range(steps):
        model(torch.randn(8, 4)).sum().backward()
        t0 = time.perf_counter()
        opt.step()
        took.append((time.perf_counter() - t0) * 1e3)
        opt.zero_grad()
    return took


def assert_phases_inside_steps(steps: pd.DataFrame, phases: pd.DataFrame, slack_ms: float = 1e-6) -> None:
    """Every phase starts and ends inside its step (``steps`` indexed by step)."""
    joined = phases.join(steps[["start_ms", "duration_ms"]].add_suffix("_step"), on="step")
    assert (joined["start_ms"] >= joined["start_ms_step"] - slack_ms).all()
    assert (joined["start_ms"] + joined["duration_ms"]
            <= joined["start_ms_step"] + joined["duration_ms_step"] + slack_ms).all()
