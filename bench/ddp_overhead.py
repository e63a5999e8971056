"""What recording costs under DistributedDataParallel: two gloo ranks on loopback.

    python bench/ddp_overhead.py [--rounds 10] [--steps 30] [--batch-size 128] [--allow-load]

Starts itself under torchrun (2 ranks). Each rank trains the CIFAR-10 Net with
dpprof.DistributedDataParallel; rounds alternate recording off and on (dpprof.record on every
rank), in one process so machine noise hits both alike. Rank 0 prints the median step time
of each arm and the ratio. Aim: at most 2% of the step. Rank 0 also says the machine's load (bench/conditions.py:
before, and the cores the two ranks and every other process took while the rounds ran); where other processes took
more than a quarter of a core, it prints the arms' medians without the ratios (``--allow-load`` prints them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

from conditions import Conditions


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import dpprof
    from dpprof.workloads import build_workload

    rank = dist.get_rank()
    workload = build_workload("cifar-lenet", args.batch_size, seed=rank)
    torch.manual_seed(0)
    ddp = dpprof.DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    batches = workload.batches()

    def steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            (x,), y = next(batches)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            workload.criterion(ddp(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
        return times

    with dpprof.record(name="bench-ddp-warmup"):
        steps(5)  # installs the communication hook, as every recorded run does
    arms: dict[str, list[float]] = {"off": [], "dpprof": []}
    cpu: dict[str, list[float]] = {"off": [], "dpprof": []}  # this rank's process CPU time per step
    ratios = []
    conditions = Conditions(root=os.getppid())  # torchrun: both ranks are below it
    if rank == 0:
        conditions.__enter__()
    for r in range(args.rounds):
        medians = {}
        for arm in (("off", "dpprof") if r % 2 == 0 else ("dpprof", "off")):
            with dpprof.record(name="bench-ddp") if arm == "dpprof" else nullcontext():
                c0 = time.process_time()
                times = steps(args.steps)
                cpu[arm].append((time.process_time() - c0) / args.steps)
            arms[arm] += times
            medians[arm] = statistics.median(times)
        ratios.append(medians["dpprof"] / medians["off"])
    if rank == 0:
        conditions.__exit__(None, None, None)
        refused = None if args.allow_load else conditions.refusal()
        print(f"cifar-lenet, batch {args.batch_size} per rank, 2 gloo ranks; {args.rounds} rounds x {args.steps} "
              "steps per arm (medians)")
        for arm, times in arms.items():
            print(f"  {arm:7s} {statistics.median(times) * 1e3:8.2f} ms/step")
        print(f"  {conditions.line()}")
    if rank == 0 and refused:
        print(f"  ratios {refused}")
    elif rank == 0:
        print(f"  recording adds {statistics.median(ratios) - 1:+.2%} of the step (median of per-round ratios; "
              "aim: <= +2%)")
        c = {arm: statistics.median(v) * 1e3 for arm, v in cpu.items()}
        print(f"  rank 0's CPU time per step, all its threads: off {c['off']:.2f} ms, dpprof {c['dpprof']:.2f} ms "
              f"({c['dpprof'] / c['off'] - 1:+.2%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--allow-load", action="store_true",
                        help="report the ratios even where other processes took the processor during the run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            _worker(args)
        finally:
            # the models _worker trained hold the process group: freed as it returned, so the group goes now, not at
            # the interpreter's end, where gloo's objects abort a rank now and then
            dist.destroy_process_group()
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           *(["--allow-load"] if args.allow_load else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPPROF_REPORTS": os.environ.get("DPPROF_REPORTS", "/tmp/dpprof-bench")}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
