"""Where a CPU-workers forward call's time goes: the hand-off, and replicas sharing the GIL.

Measures, on 2 CPU workers (no recording):

- the round trip of handing each worker a task that does nothing and getting the results back;
- one replica's forward of the MLP 64-128-128-10 on half of a batch of 64, run alone on the calling
  thread, against the same two replicas run at once on the two workers: from the hand-off to each
  worker starting, each replica's own time while the other runs, and from the later one's end to
  the caller having both results.

- the CPU time per training step (forward, loss, backward, SGD) of each thread, for the plain
  module and for dpprof.DataParallel on the workers: the calling thread, the two workers, and the
  rest (the calling thread's OpenMP team, which spins between parallel regions). Linux only.

- how long the calling thread's OpenMP helper spins after one parallel region (the process's CPU
  time while the caller sleeps after a large add), and what that does to the tutorial's CIFAR-10
  Net (batch 256, no grad): its two halves on the workers with nothing run on the caller before,
  the same right after a parallel op on the caller, with the helper left spinning and with the
  caller releasing it first (what run_on_workers does after long calls), and dpprof.DataParallel,
  whose replicas copy the largest weight (48,000 elements, a copy torch makes with several
  threads) on their own workers (made on the caller, it left the helper spinning as the workers
  started).

What it shows is the floor under bench/overhead.py's CPU-workers-vs-plain ratio on a step that
fixed costs dominate: every torch op releases the GIL and takes it back, and with two replicas
running Python at once each op can wait for the other thread to be woken and give the GIL up;
and on a machine with as many cores as workers, the calling thread's OpenMP helpers compete with
the workers for the cores.

    python bench/workers.py [--calls 3000] [--steps 3000] [--forwards 60]
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from torch import nn

import dpprof
from dpprof.parallel import workers
from dpprof.parallel.workers import run_on_workers

_now = time.perf_counter_ns


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native thread id (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _cpu_by_thread(model: nn.Module, net: nn.Module, steps: int) -> None:
    """Each thread's CPU per training step, plain module and CPU workers."""
    if not os.path.isdir("/proc/self/task"):
        print("  (CPU by thread: needs Linux /proc)")
        return
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    caller = threading.get_native_id()
    print(f"  CPU per training step by thread, {steps} steps (wall per step; calling thread / workers / the rest):")
    for name, m in (("plain module", model), ("2 CPU workers", net)):
        for _ in range(steps // 10):
            optimizer.zero_grad()
            criterion(m(x), y).backward()
            optimizer.step()
        before, t0 = _thread_cpu_s(), time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            criterion(m(x), y).backward()
            optimizer.step()
        wall, after = time.perf_counter() - t0, _thread_cpu_s()
        workers = {t.native_id for t in threading.enumerate() if t.name.startswith("dpprof-cpu:")}
        used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
        mine = used.get(caller, 0.0)
        on_workers = sum(v for tid, v in used.items() if tid in workers)
        rest = sum(used.values()) - mine - on_workers
        per = 1e6 / steps
        print(f"    {name:14s} {wall * per:7.1f} us: {mine * per:7.1f} / {on_workers * per:7.1f} / {rest * per:7.1f} us")


def _median_ms(fn, calls: int) -> float:
    for _ in range(max(2, calls // 10)):
        fn()
    times = []
    for _ in range(calls):
        t0 = _now()
        fn()
        times.append(_now() - t0)
    return statistics.median(times) / 1e6


def _openmp_spin(calls: int) -> None:
    """The calling thread's OpenMP helper spinning after a parallel region, and the cost to CPU workers."""
    from dpprof.workloads import build_workload

    big = torch.ones(4_000_000)
    spun = []
    for _ in range(5):
        big.add_(1)  # a parallel region: the helper works, then spins waiting for the next one
        c0 = time.process_time()
        time.sleep(0.05)
        spun.append(time.process_time() - c0)
    print(f"  the calling thread's OpenMP helper after one parallel region: {statistics.median(spun) * 1e3:.1f} ms"
          " of CPU spinning in the next 50 ms (the caller asleep)")
    w = build_workload("cifar-lenet", 256)
    (x,), _ = next(w.batches())
    halves = [h.contiguous() for h in x.chunk(2)]
    net = dpprof.DataParallel(w.model, dpprof.cpu_devices(2))
    tasks = [lambda: w.model(halves[0]), lambda: w.model(halves[1])]

    def after_parallel_op() -> None:
        big.add_(1)
        run_on_workers([0, 1], tasks)

    with torch.no_grad():
        plain = _median_ms(lambda: w.model(x), calls)
        quiet = _median_ms(lambda: run_on_workers([0, 1], tasks), calls)
        t_op = _median_ms(lambda: big.add_(1), calls)
        released = _median_ms(after_parallel_op, calls) - t_op
        pause_after, workers.PAUSE_AFTER_S = workers.PAUSE_AFTER_S, float("inf")
        try:
            noisy = _median_ms(after_parallel_op, calls) - t_op
        finally:
            workers.PAUSE_AFTER_S = pause_after
        dp = _median_ms(lambda: net(x), calls)
    print(f"  CIFAR-10 Net forward, batch 256, no grad (medians of {calls} calls):")
    print(f"    plain module on the caller ({torch.get_num_threads()} intra-op threads):      {plain:6.2f} ms")
    print(f"    two halves on 2 workers, nothing run on the caller before: {quiet:6.2f} ms")
    print(f"    the same right after a parallel op on the caller:         {noisy:6.2f} ms (the op's own time taken off)")
    print(f"    the same, the caller releasing its helper first:           {released:6.2f} ms (the helper's restart"
          " included)")
    print(f"    dpprof.DataParallel (its replicas copy on their workers):   {dp:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=3000, help="training steps for the CPU-by-thread figures")
    parser.add_argument("--forwards", type=int, default=60, help="CIFAR-10 Net forward calls per figure")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    halves = torch.randn(64, 64).chunk(2)
    warm = args.calls // 10

    def noop() -> None:
        return None

    trips = []
    for i in range(warm + args.calls):
        t0 = _now()
        run_on_workers([0, 1], [noop, noop])
        if i >= warm:
            trips.append(_now() - t0)

    alone = []
    for i in range(warm + args.calls):
        t0 = _now()
        model(halves[0])
        if i >= warm:
            alone.append(_now() - t0)

    def replica(x: torch.Tensor, times: list[int]):
        def run() -> torch.Tensor:
            times.append(_now())
            out = model(x)
            times.append(_now())
            return out
        return run

    rows = []
    for i in range(warm + args.calls):
        a: list[int] = []
        b: list[int] = []
        t0 = _now()
        run_on_workers([0, 1], [replica(halves[0], a), replica(halves[1], b)])
        t1 = _now()
        if i >= warm:
            rows.append((min(a[0], b[0]) - t0, a[1] - a[0], b[1] - b[0], t1 - max(a[1], b[1]), t1 - t0))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; medians of {args.calls} calls")
    print(f"  hand-off round trip, a no-op task on each of 2 workers: {_median_us(trips):7.1f} us")
    print(f"  one MLP replica (batch 32, grad on) alone on the caller: {_median_us(alone):7.1f} us")
    print("  the two replicas at once on 2 workers:")
    print(f"    hand-off to the first worker starting:                {_median_us([r[0] for r in rows]):7.1f} us")
    print(f"    replica 0 / replica 1 while the other runs:           {_median_us([r[1] for r in rows]):7.1f}"
          f" / {_median_us([r[2] for r in rows]):.1f} us")
    print(f"    the later one's end to the caller holding both:       {_median_us([r[3] for r in rows]):7.1f} us")
    print(f"    the whole call:                                        {_median_us([r[4] for r in rows]):7.1f} us"
          f" (the two replicas one after the other on the caller: {2 * _median_us(alone):.1f} us)")
    _cpu_by_thread(model, dpprof.DataParallel(model, dpprof.cpu_devices(2)), args.steps)
    _openmp_spin(args.forwards)


if __name__ == "__main__":
    main()
