"""What recording costs: the tutorial's CIFAR-10 Net, batch 256, on 2 CPU workers.

Three arms, interleaved round by round in one process so that machine noise hits them
alike: recording off, recording on (dpprof.record), and the same step under torch.profiler
(CPU activities, every thread: the replicas run in worker threads).
Prints the median step time of each and the ratios. Aim: recording adds at most 2% to the
step and at most a tenth of what torch.profiler adds.

    python bench/overhead.py [--rounds 10] [--steps 30] [--batch-size 256] [--workers 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

import dpprof
from dpprof.workloads import build_workload


def _steps(net, workload, optimizer, batches, n, run=None):
    times = []
    for _ in range(n):
        x, y = next(batches)
        t0 = time.perf_counter()
        with run.step() if run is not None else nullcontext():
            optimizer.zero_grad(set_to_none=True)
            workload.criterion(net(*x), y).backward()
            optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="steps per arm per round")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    workload = build_workload("cifar-lenet", args.batch_size)
    net = dpprof.DataParallel(workload.model, device_ids=dpprof.cpu_devices(args.workers))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = workload.batches()
    _steps(net, workload, optimizer, batches, 5)  # warm-up

    def off() -> list[float]:
        return _steps(net, workload, optimizer, batches, args.steps)

    def recorded() -> list[float]:
        with dpprof.record(name="bench-overhead") as run:
            return _steps(net, workload, optimizer, batches, args.steps, run)

    # every thread: without it the profiler sees none of the replicas' work (their threads are not the caller's)
    all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)

    def profiled() -> list[float]:
        with profile(activities=[ProfilerActivity.CPU], experimental_config=all_threads):
            return _steps(net, workload, optimizer, batches, args.steps)

    runners = {"off": off, "dpprof": recorded, "torch.profiler": profiled}
    arms: dict[str, list[float]] = {k: [] for k in runners}
    ratios: dict[str, list[float]] = {"dpprof": [], "torch.profiler": []}
    walls: dict[str, list[float]] = {k: [] for k in runners}  # whole arm, start-up and teardown included
    per_round: dict[str, list[list[float]]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}  # process CPU seconds per step, all threads
    for r in range(args.rounds):
        order = list(runners)[r % 3:] + list(runners)[:r % 3]  # rotate so no arm always runs first
        round_med = {}
        for k in order:
            t0, c0 = time.perf_counter(), time.process_time()
            times = runners[k]()
            walls[k].append(time.perf_counter() - t0)
            cpu[k].append((time.process_time() - c0) / args.steps)
            per_round[k].append(times)
            arms[k] += times
            round_med[k] = statistics.median(times)
        for k in ratios:
            ratios[k].append(round_med[k] / round_med["off"])

    med = {k: statistics.median(v) * 1e3 for k, v in arms.items()}
    print(f"cifar-lenet batch {args.batch_size} on {args.workers} CPU workers, "
          f"{args.rounds} rounds x {args.steps} steps per arm (medians)")
    for k, v in med.items():
        print(f"  {k:15s} {v:8.2f} ms/step")
    # the median over rounds of each round's ratio: robust to drift between rounds
    rec = statistics.median(ratios["dpprof"]) - 1
    prof = statistics.median(ratios["torch.profiler"]) - 1
    print(f"  dpprof recording adds      {rec:+.2%} of the step (aim: <= +2%)")
    print(f"  torch.profiler adds        {prof:+.2%} of the step")
    # CPU time is what the work costs, whoever else shares the machine: steadier than wall time here
    cpu_med = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    print("  process CPU time per step, all threads (less sensitive to other load on the machine):")
    for k, v in cpu_med.items():
        print(f"    {k:13s} {v:8.2f} ms  ({v / cpu_med['off'] - 1:+.2%})")
    # what a recording costs once, whatever its length: the arm's wall time less its steps
    fixed = {k: statistics.median(w - sum(t) for w, t in zip(walls[k], per_round[k])) * 1e3 for k in walls}
    print("  once per recording (the arm's wall time less its steps, median):")
    print(f"    dpprof          {fixed['dpprof'] - fixed['off']:8.2f} ms  (create the run file; at close, "
          "commit, compute and store the findings)")
    print(f"    torch.profiler  {fixed['torch.profiler'] - fixed['off']:8.2f} ms  (start, and build the trace at exit)")
    if prof > 0:
        print(f"  dpprof / torch.profiler    {rec / prof:.3f} of the profiler's cost (aim: <= 0.1)")


if __name__ == "__main__":
    main()
