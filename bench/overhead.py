"""What recording costs, and what CPU workers cost against the plain module, on two steps.

Steps: the tutorial's CIFAR-10 Net at batch 256, and an MLP 64-128-128-10 at batch 64 (a step
small enough that fixed costs per forward call show), each on 2 CPU workers with SGD.

Arms, interleaved round by round in one process so that machine noise hits them alike:

- plain: the bare module, no DataParallel (for the CPU-workers-vs-plain ratio);
- off: dpprof.DataParallel on the workers, nothing recording;
- memory: recording into memory only (``dpprof.record(store=False)``), ``with run.step():`` around each
  step: timing and memory accounting;
- dpprof explicit: recording into a run file (the writer thread included), ``with run.step():`` around
  each step, as the README's "Wrap a model" shows;
- dpprof implicit: the same run file, no run.step(): each forward call starts a step;
- dpprof captured: as dpprof explicit, with a deep capture (``capture="0:2"``) in the steps before the timed
  ones, its trace and tables stored before they start: what a run pays outside its capture window;
- torch.profiler: CPU activities on every thread (it sees no replica otherwise), nothing recording.

With ``--device cuda`` the same steps run on GPU 0 instead: the module on cuda:0 (plain),
dpprof.DataParallel(device_ids=[0]) for the other arms, torch.nn.DataParallel(device_ids=[0]) as
one more arm, and torch.profiler with CPU and CUDA activities. Every block ends with a
synchronize, so the GPU's work is inside the time. One GPU cannot show DataParallel over several:
this measures what recording costs per step on a real device (CUDA events, allocator counters,
NVML sampling).

Each arm runs a block of steps per round, after a tenth as many steps not timed: an arm pays
there for what the arm before it left behind (seen: whichever recording arm came right after
``off`` paid ~0.4 ms a step more on the MLP). Round by round the order rotates and, every other
round, reverses, so no arm is always first or always after the same arm. Reported per arm: the mean step over its blocks
(what a user pays, periodic work such as the writer's commits included), the median over
rounds of each round's ratio to ``off`` and of the microseconds it adds per step (with the middle
half of the rounds: how far the machine's noise moves one round), the process CPU time per step
(all threads), and the calling thread's CPU time added per step. For each dpprof arm's added share
of a step and its ratio to torch.profiler's added time, and for what explicit steps add over implicit
ones, a 95% interval: the rounds resampled (paired) 2,000 times. No ratio is printed where the profiler's added time cannot be told from zero. A
recording's own start and close (creating the file; the last commit and the findings at close)
are outside the blocks and reported once, with the collection of the garbage the arm left (every
arm ends with gc.collect(), so no arm's block pays for another's: torch.profiler's parsed trace is
cyclic garbage, and the first recording block after it used to pay 70-150 ms to collect it).

Each step's table ends with the machine's load (bench/conditions.py): the load average before, and the cores the
machine, the bench and every other process kept busy while it ran. Where other processes took more than a quarter
of a core on average, only the arms' mean steps are printed, not the ratios (``--allow-load`` prints them anyway).

``--threads 1`` runs the calling thread (its loss, backward and optimizer) on one intra-op thread; each worker
runs on one either way (the caller's count split between 2 workers). With the default 2 on this 2-core machine, the
caller's OpenMP helper spins after every parallel region of the MLP's step and keeps a core busy (615 us of CPU a
0.7 ms step, read from /proc per thread), so every arm's threads share one core with it and the MLP's rounds move
by +-100 us; at 1 the middle half of the rounds' added microseconds narrowed from [-3, +198] to [+49, +75] on the
same machine (2026-11-27), the arms' means within each other's spread.

    python bench/overhead.py [--rounds N] [--workers 2] [--only cifar-lenet|mlp] [--threads N] [--device cpu|cuda]
                             [--allow-load]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import dpprof
from dpprof.parallel import workers as cpu_workers
from dpprof.workloads import build_workload

from conditions import Conditions
from stats import interval, median_interval

ARMS = ("plain", "off", "memory", "dpprof explicit", "dpprof implicit", "dpprof captured", "torch.profiler")
CUDA_ARMS = ("plain", "torch DataParallel", "off", "memory", "dpprof explicit", "dpprof implicit", "dpprof captured",
             "torch.profiler")
CAPTURED_WINDOW = "0:2"  # the deep capture of the "dpprof captured" arm: within the untimed steps of every block
RECORDED = ("dpprof explicit", "dpprof implicit")  # recording into a run file, as users do


@dataclass
class Step:
    name: str
    model: nn.Module
    criterion: nn.Module
    batches: Callable[[], Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]]
    # over a second of steps (1.2 s of cifar-lenet, 1.4 s of the MLP): the run file's writer commits every
    # FLUSH_INTERVAL_S (0.5 s) from the recording's start, so each recorded block holds its commits at their
    # steady rate. The MLP's blocks were 300 steps (0.2 s) until 2026-11-27 and held none: their figures left out
    # the writer's work (measured in one process, 3,000-step blocks added +92 us a step against +63 for 300-step ones)
    block_steps: int
    rounds: int  # default rounds


def _cifar() -> Step:
    w = build_workload("cifar-lenet", 256)
    return Step("cifar-lenet, batch 256", w.model, w.criterion, w.batches, 40, 16)


def _mlp() -> Step:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def batches():
        while True:
            yield (x,), y

    return Step("MLP 64-128-128-10, batch 64", model, nn.CrossEntropyLoss(), batches, 2000, 16)


def _on_gpu(step: Step) -> Step:
    """The same step on cuda:0: model, loss and a fixed batch on the GPU (no host copies in the step)."""
    device = torch.device("cuda", 0)
    step.model.to(device)
    step.criterion.to(device)
    (x, *rest), y = next(step.batches())
    x, y = x.to(device), y.to(device)

    def batches():
        while True:
            yield (x,), y

    # cifar-lenet's GPU step is several times shorter than on CPU workers: six times its blocks, over a second again
    # (the MLP's is not shorter: its 2,000 steps stay)
    return Step(step.name, step.model, step.criterion, batches, step.block_steps * (6 if step.block_steps < 100 else 1),
                step.rounds)


def _steps(net: nn.Module, step: Step, optimizer: torch.optim.Optimizer, batches, n: int, run=None) -> None:
    """n training steps, each in ``with run.step():`` when a run is given (else each forward call starts one
    inside a recording)."""
    for _ in range(n):
        x, y = next(batches)
        with run.step() if run is not None else nullcontext():
            optimizer.zero_grad(set_to_none=True)
            step.criterion(net(*x), y).backward()
            optimizer.step()


def _block(net: nn.Module, step: Step, optimizer: torch.optim.Optimizer, batches, n: int,
           run=None) -> tuple[float, float, float, float]:
    """(wall seconds, process CPU seconds) of n steps, the GPU's work included, after n // 10 steps not
    timed (what the arm before left behind, caches and threads, is paid there), those steps' seconds, and
    the calling thread's CPU seconds in the n steps."""
    cuda = torch.cuda.is_available() and next(step.model.parameters()).is_cuda
    t_settle = time.perf_counter()
    _steps(net, step, optimizer, batches, max(2, n // 10), run)
    if cuda:
        torch.cuda.synchronize()
    frozen = run is not None and bool(run.capture.wait())  # a window in the untimed steps: stored before the timed ones
    if frozen:
        # the profiler's garbage must not be collected in a timed step (70-150 ms), nor collected here: a collection
        # just before 300 steps of the MLP made them about 50 us a step slower (a paired test, 30 rounds), and
        # this arm alone collecting here read as the capture's cost outside its window (+58 to +190 us a step).
        # Frozen, the collector leaves it alone and the heap stays as the other arms' is; collected after the block.
        gc.freeze()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    _steps(net, step, optimizer, batches, n, run)
    if cuda:
        torch.cuda.synchronize()
    wall, cpu, caller = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0
    if frozen:
        gc.unfreeze()  # collected with the arm's garbage, once its block is timed
    return wall, cpu, t0 - t_settle, caller


def measure(step: Step, workers: int, rounds: int, reports_dir: str,
            cuda: bool = False) -> dict[str, dict[str, list[float]]]:
    net = dpprof.DataParallel(step.model, device_ids=[0] if cuda else dpprof.cpu_devices(workers))
    optimizer = torch.optim.SGD(step.model.parameters(), lr=0.01, momentum=0.9)
    batches = step.batches()
    n = step.block_steps
    all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def plain() -> tuple[float, float, float, float]:
        return _block(step.model, step, optimizer, batches, n)

    def off() -> tuple[float, float, float, float]:
        return _block(net, step, optimizer, batches, n)

    theirs = nn.DataParallel(step.model, device_ids=[0]) if cuda else None

    def torch_dp() -> tuple[float, float, float, float]:
        return _block(theirs, step, optimizer, batches, n)

    def recorded(store: bool, explicit: bool, capture: str | None = None
                 ) -> Callable[[], tuple[float, float, float, float]]:
        def arm() -> tuple[float, float, float, float]:
            with dpprof.record(name="bench-overhead", store=store, reports_dir=reports_dir, capture=capture) as run:
                return _block(net, step, optimizer, batches, n, run if explicit else None)
        return arm

    def profiled() -> tuple[float, float, float, float]:
        with profile(activities=activities, experimental_config=all_threads):
            return _block(net, step, optimizer, batches, n)

    runners = {"plain": plain, "off": off, "memory": recorded(False, True), "dpprof explicit": recorded(True, True),
               "dpprof implicit": recorded(True, False), "dpprof captured": recorded(True, True, CAPTURED_WINDOW),
               "torch.profiler": profiled}
    if cuda:
        runners = {"plain": plain, "torch DataParallel": torch_dp, **{k: v for k, v in runners.items() if k != "plain"}}
    for arm in ("plain", "off", *RECORDED, "dpprof captured"):
        runners[arm]()  # warm-up: worker threads, allocator, the first run file
    out: dict[str, dict[str, list[float]]] = {k: {"step_s": [], "cpu_s": [], "caller_s": [], "once_s": []} for k in runners}
    for r in range(rounds):
        # no arm always first, and none always after the same arm: an arm pays for what the one before
        # it left (seen: whichever recording arm came right after `off` paid ~0.4 ms a step more)
        order = list(runners)[r % len(runners):] + list(runners)[:r % len(runners)]
        if r % 2:
            order.reverse()
        for k in order:
            t0 = time.perf_counter()
            steps_s, cpu, settle_s, caller = runners[k]()
            # the arm's cyclic garbage (torch.profiler's parsed trace, a run's findings) is collected now and
            # counted in its once-per-recording time: left alone, it is collected in whichever later block
            # first allocates enough to start a collection (70-150 ms seen), and the recording arms, which
            # allocate, paid for the profiler's trace while `off` did not
            gc.collect()
            wall = time.perf_counter() - t0
            out[k]["step_s"].append(steps_s / n)
            out[k]["cpu_s"].append(cpu / n)
            out[k]["caller_s"].append(caller / n)
            out[k]["once_s"].append(wall - steps_s - settle_s)
    return out


def report(name: str, workers: int, rounds: int, n: int, out: dict[str, dict[str, list[float]]],
           cuda: bool = False, refused: str | None = None) -> None:
    """Print the arms' figures and ratios; with ``refused`` (the machine was loaded: bench/conditions.py), the
    arms' mean steps only, then why nothing else is reported."""
    def per_round(k: str, field: str, f: Callable[[float, float], float]) -> list[float]:
        """Each round's ``f(arm k, off)``: the rounds are paired, noise moves a round's arms alike."""
        return [f(a, b) for a, b in zip(out[k][field], out["off"][field])]

    def paired(k: str, field: str, f: Callable[[float, float], float]) -> float:
        return statistics.median(per_round(k, field, f))

    def quartiles(k: str) -> tuple[float, float] | None:
        """The middle half of the rounds' added microseconds: how far the machine's noise moves them."""
        added = per_round(k, "step_s", lambda a, b: (a - b) * 1e6)
        if len(added) < 4:
            return None
        q1, _, q3 = statistics.quantiles(added, n=4)
        return q1, q3

    def spread(k: str) -> str:
        q = quartiles(k)
        return f"  [{q[0]:+.0f}, {q[1]:+.0f}]" if q else ""

    where = f"GPU 0 ({torch.cuda.get_device_name(0)})" if cuda else f"{workers} CPU workers"
    print(f"\n{name} on {where}: {rounds} rounds x {n} steps per arm")
    print(f"  {'arm':18s} {'mean step':>10s} {'added':>9s} {'added/step':>11s} {'CPU/step':>10s} {'CPU added':>9s}"
          "  added/step, middle half of rounds")
    for k in CUDA_ARMS if cuda else ARMS:
        mean_ms = statistics.fmean(out[k]["step_s"]) * 1e3
        cpu_ms = statistics.fmean(out[k]["cpu_s"]) * 1e3
        if k in ("plain", "off", "torch DataParallel") or refused:
            print(f"  {k:18s} {mean_ms:8.3f}ms {'':>9s} {'':>11s} {cpu_ms:8.3f}ms")
            continue
        added = paired(k, "step_s", lambda a, b: a / b - 1)
        added_us = paired(k, "step_s", lambda a, b: (a - b) * 1e6)
        cpu_added = paired(k, "cpu_s", lambda a, b: a / b - 1)
        print(f"  {k:18s} {mean_ms:8.3f}ms {added:+9.2%} {added_us:+9.1f}us {cpu_ms:8.3f}ms {cpu_added:+9.2%}"
              f"{spread(k)}")
    if refused:
        print(f"  ratios {refused}")
        return
    mem = paired("memory", "step_s", lambda a, b: (a - b) * 1e6)
    prof = paired("torch.profiler", "step_s", lambda a, b: (a - b) * 1e6)
    workers_ratios = [o / p for o, p in zip(out["off"]["step_s"], out["plain"]["step_s"])]
    workers_ratio = statistics.median(workers_ratios)
    if cuda:
        theirs = statistics.median(o / p for o, p in zip(out["off"]["step_s"], out["torch DataParallel"]["step_s"]))
        print(f"  dpprof.DataParallel off / plain module: {workers_ratio:.3f}x; / torch.nn.DataParallel: {theirs:.3f}x"
              " (medians of rounds)")
    else:
        lo, hi = median_interval(workers_ratios)
        of_means = statistics.fmean(out["off"]["step_s"]) / statistics.fmean(out["plain"]["step_s"])
        print(f"  CPU workers / plain module: {workers_ratio:.2f}x (median of rounds; 95% interval {lo:.2f}x to"
              f" {hi:.2f}x); of the mean steps: {of_means:.2f}x")
    callers = {k: paired(k, "caller_s", lambda a, b: (a - b) * 1e6) for k in ("memory", *RECORDED, "torch.profiler")}
    print("  the calling thread's CPU added per step: "
          + ", ".join(f"{k} {v:+.1f} us" for k, v in callers.items()) + " (median of rounds)")
    explicit = paired("dpprof explicit", "step_s", lambda a, b: (a - b) * 1e6)
    print(f"  dpprof explicit per step: {explicit:+.1f} us = timing and memory accounting {mem:+.1f} us"
          f" + the run file's writer {explicit - mem:+.1f} us")
    profilers = per_round("torch.profiler", "step_s", lambda a, b: a - b)
    for k in RECORDED:
        ratios = per_round(k, "step_s", lambda a, b: a / b - 1)
        lo, hi = median_interval(ratios)
        print(f"  {k} adds {statistics.median(ratios):+.2%} a step (95% interval of that median: {lo:+.2%} to"
              f" {hi:+.2%})")
        ours = per_round(k, "step_s", lambda a, b: a - b)

        def share(idx: list[int]) -> float:
            den = statistics.median(profilers[i] for i in idx)
            return statistics.median(ours[i] for i in idx) / den if den > 0 else math.inf

        lo, hi = interval(len(ours), share)
        if prof <= 0 or math.isinf(hi):
            print(f"  {k} / torch.profiler: not measurable here: the profiler's added time cannot be told from zero")
        else:
            print(f"  {k} / torch.profiler: {statistics.median(ours) * 1e6 / prof:.2f} of the profiler's added time"
                  f" (95% interval {lo:.2f} to {hi:.2f}; aim: <= 0.5)")
    # paired per round like every figure here: the two arms ran in the same round, each beside `off`
    over = [(a - b) * 1e6 for a, b in zip(out["dpprof explicit"]["step_s"], out["dpprof implicit"]["step_s"])]
    lo, hi = median_interval(over)
    print(f"  explicit steps over implicit ones: {statistics.median(over):+.1f} us a step (95% interval {lo:+.1f} to"
          f" {hi:+.1f}; aim: <= 0)")
    # the deep capture's cost outside its window: the captured arm beside the explicit one, paired per round
    outside = [(a - b) * 1e6 for a, b in zip(out["dpprof captured"]["step_s"], out["dpprof explicit"]["step_s"])]
    ratios = [a / b for a, b in zip(out["dpprof captured"]["step_s"], out["dpprof explicit"]["step_s"])]
    lo, hi = median_interval(outside)
    print(f"  a deep capture's steps outside its window over dpprof explicit: {statistics.median(outside):+.1f} us a "
          f"step, {statistics.median(ratios):.3f}x (95% interval {lo:+.1f} to {hi:+.1f} us; aim: 0)")
    once = {k: statistics.median(out[k]["once_s"]) * 1e3 for k in ("off", *RECORDED, "dpprof captured",
                                                                 "torch.profiler")}
    print(f"  once per recording: dpprof {once['dpprof explicit'] - once['off']:.1f} ms explicit,"
          f" {once['dpprof implicit'] - once['off']:.1f} ms implicit (create the file; at close the last commit and"
          f" the findings; its garbage collected), {once['dpprof captured'] - once['off']:.1f} ms with a deep capture"
          f" (its window and storing it are in the untimed steps), torch.profiler {once['torch.profiler'] - once['off']:.1f} ms"
          " (its trace parsed, then collected)")


def where_time_goes(step: Step, workers: int, reports_dir: str, cuda: bool) -> None:
    """One block of each dpprof arm (explicit steps, then implicit ones) under cProfile: the function calls
    per step and the top functions by own time. Python 3.11's cProfile sees the calling thread only; from
    3.12 it is built on sys.monitoring and sees every thread (the writer's and NVML sampler's calls then
    appear beside the step's)."""
    import cProfile
    import pstats

    net = dpprof.DataParallel(step.model, device_ids=[0] if cuda else dpprof.cpu_devices(workers))
    optimizer = torch.optim.SGD(step.model.parameters(), lr=0.01)
    batches = step.batches()
    threads = "every thread" if sys.version_info >= (3, 12) else "calling thread"
    for k in RECORDED:
        with dpprof.record(name="bench-cprofile", reports_dir=reports_dir) as run:
            steps_run = run if k == "dpprof explicit" else None
            _steps(net, step, optimizer, batches, 5, steps_run)
            profiler = cProfile.Profile()
            profiler.enable()
            _steps(net, step, optimizer, batches, step.block_steps, steps_run)
            profiler.disable()
        stats = pstats.Stats(profiler)
        print(f"  cProfile of {step.block_steps} steps of {k} ({threads}): {stats.total_calls / step.block_steps:.1f}"
              f" function calls a step; top 20 by own time:")
        stats.sort_stats("tottime").print_stats(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds per step (default: 16)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", choices=["cifar-lenet", "mlp"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: CPU workers (default); cuda: the steps on GPU 0")
    parser.add_argument("--allow-load", action="store_true",
                        help="report the ratios even where other processes took the processor during the run")
    parser.add_argument("--threads", type=int,
                        help="the calling thread's intra-op threads (default: torch's own, one per core); 1 keeps its"
                             " OpenMP helper from spinning on a core every step (see the docstring)")
    parser.add_argument("--cprofile", action="store_true",
                        help="then one more block of the dpprof arm under cProfile: where its time goes")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # before any parallel region: the helper threads are never started
    steps = {"cifar-lenet": _cifar, "mlp": _mlp}
    spin = os.environ.get("GOMP_SPINCOUNT")
    released = ("the caller's OpenMP helpers released before long worker calls" if cpu_workers._omp_pause is not None
                else "no omp_pause_resource_all found: the caller's OpenMP helpers are never released")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
          + (f", GOMP_SPINCOUNT={spin}" if spin else "")
          + (f", {torch.cuda.get_device_name(0)}" if cuda else f"; {released}"))
    for key, make in steps.items():
        if args.only in (None, key):
            step = _on_gpu(make()) if cuda else make()
            with tempfile.TemporaryDirectory(prefix="dpprof-bench-") as reports_dir:  # not the user's reports/
                rounds = args.rounds or step.rounds
                with Conditions() as conditions:
                    out = measure(step, args.workers, rounds, reports_dir, cuda)
                refused = None if args.allow_load else conditions.refusal()
                report(step.name, args.workers, rounds, step.block_steps, out, cuda, refused)
                print(f"  {conditions.line()}")
                if args.cprofile:
                    where_time_goes(step, args.workers, reports_dir, cuda)


if __name__ == "__main__":
    main()
