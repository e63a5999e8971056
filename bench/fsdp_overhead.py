"""What recording FSDP2 costs, against what torch.profiler adds: two gloo ranks on loopback.

Starts itself under torchrun (2 ranks). Each rank trains two models sharded with ``fully_shard`` (per layer and on
the root): an MLP and a small transformer encoder. Rounds interleave four arms in one process so machine noise hits
them alike: nothing recording ("off"), ``dpprof.record`` with dpprof.parallel.fsdp's hooks kept in memory ("memory":
no run file, no writer thread), the same into a run file ("dpprof"; what it adds over "memory" is the writer's), and
``torch.profiler.profile`` of the CPU activity ("torch.profiler"); the order rotates round by round and reverses
every other round, so no arm is always first or always after the same arm. Each arm's block runs a tenth of its steps
untimed, then ``--steps`` timed ones; after the block both ranks collect the arm's garbage and meet at a barrier,
so no block pays for another arm's parsed trace or findings (a recorder's own start and close are outside the
blocks). The first round warms every arm up and is left out. Rank 0 prints each arm's mean step over its blocks
(what a user pays, the writer's periodic commits included), what each recorder adds a step (the mean of each round's
difference to ``off``) and dpprof's added time over torch.profiler's, each with a 95% interval (the rounds resampled
together, bench/stats.py), for the wall clock, for rank 0's CPU time (all its threads) and for its training
thread's. Aim: at most half of torch.profiler's. Rank 0 also says the machine's load (bench/conditions.py: before, and while each model's rounds ran, the cores
taken by the two ranks and by every other process); where other processes took more than a quarter of a core, it
prints the arms' mean steps without the ratios (``--allow-load`` prints them anyway).

    python bench/fsdp_overhead.py [--rounds 12] [--steps 50] [--allow-load]
"""
from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Any

from conditions import Conditions
from stats import interval

ARMS = ("off", "memory", "dpprof", "torch.profiler")
RECORDERS = ARMS[1:]


def _models(torch: Any) -> dict[str, Any]:
    nn = torch.nn
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)], nn.Linear(256, 10))
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128,
                                                               batch_first=True, dropout=0.0), num_layers=2,
                                    enable_nested_tensor=False)
    return {"mlp": (mlp, lambda g: torch.randn(32, 256, generator=g), list(mlp)[:-1]),
            "transformer": (encoder, lambda g: torch.randn(16, 32, 64, generator=g), list(encoder.layers))}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    import dpprof
    from dpprof.parallel import fsdp

    rank = dist.get_rank()
    fsdp.install()
    torch.manual_seed(0)
    for name, (model, batch, layers) in _models(torch).items():
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)

        def block(n: int) -> tuple[float, float, float]:
            """Mean seconds per step over n steps: wall clock, this process's CPU time (all its threads) and the
            training thread's."""
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(n):
                optimizer.zero_grad(set_to_none=True)
                model(batch(gen)).float().pow(2).mean().backward()
                optimizer.step()
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n, (time.thread_time() - m0) / n

        def recorder(arm: str) -> Any:
            if arm == "memory":  # the same recording kept in memory: no run file, no writer thread
                return dpprof.record(name=f"bench-fsdp-{name}", sample_hz=None, store=False)
            if arm == "dpprof":
                return dpprof.record(name=f"bench-fsdp-{name}", sample_hz=None)
            if arm == "torch.profiler":
                return profile(activities=[ProfilerActivity.CPU])
            return nullcontext()

        means: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
        caller: dict[str, list[float]] = {arm: [] for arm in ARMS}
        conditions = Conditions(root=os.getppid())  # torchrun: both ranks are below it
        if rank == 0:
            conditions.__enter__()
        for r in range(args.rounds + 1):
            order = list(ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)])
            if r % 2:
                order.reverse()
            for arm in order:
                with recorder(arm):
                    block(max(2, args.steps // 10))  # not timed: what the arm before left behind is paid here
                    seconds, cpu_seconds, caller_seconds = block(args.steps)
                # the arm's garbage (torch.profiler's parsed trace, a run's findings) is collected here, on both
                # ranks, and they start the next block together: left alone, it is collected in whichever later
                # block first allocates enough, and one rank's collection is the other's wait in a collective
                gc.collect()
                dist.barrier()
                if r > 0:  # the first round warms every arm up
                    means[arm].append(seconds)
                    cpu[arm].append(cpu_seconds)
                    caller[arm].append(caller_seconds)
        if rank == 0:
            conditions.__exit__(None, None, None)
            _report(name, args, means, cpu, caller, conditions, None if args.allow_load else conditions.refusal())


def _report(name: str, args: argparse.Namespace, means: dict[str, list[float]], cpu: dict[str, list[float]],
            caller: dict[str, list[float]], conditions: Conditions, refused: str | None) -> None:
    """Rank 0's figures: each arm's mean step over its blocks; what each recorder adds a step (the mean over the
    rounds of each round's difference to ``off``: the rounds are paired) with its 95% interval, and dpprof's added
    time over torch.profiler's with its interval, the rounds resampled together: for the wall clock, for rank 0's CPU
    time (all its threads: gloo's and dpprof's writer too) and for rank 0's training thread alone."""
    print(f"{name}: 2 gloo ranks, {args.rounds} rounds x {args.steps} steps per arm (mean ms per step)")
    for arm in ARMS:
        print(f"  {arm:15s} {statistics.fmean(means[arm]) * 1e3:8.2f} ms/step,"
              f" rank 0's CPU {statistics.fmean(cpu[arm]) * 1e3:8.2f} ms/step, its training thread's"
              f" {statistics.fmean(caller[arm]) * 1e3:8.2f} ms/step")
    print(f"  {conditions.line()}")
    if refused:
        print(f"  ratios {refused}", flush=True)
        return
    n = len(means["off"])
    for what, table in (("wall", means), ("rank 0's CPU", cpu), ("rank 0's training thread's CPU", caller)):
        added = {arm: [(a - b) * 1e3 for a, b in zip(table[arm], table["off"])] for arm in RECORDERS}
        added["the writer"] = [a - b for a, b in zip(added["dpprof"], added["memory"])]  # dpprof less memory

        def mean_of(arm: str, idx: list[int]) -> float:
            return statistics.fmean(added[arm][i] for i in idx)

        def share(arm: str, idx: list[int]) -> float:
            theirs = mean_of("torch.profiler", idx)
            return mean_of(arm, idx) / theirs if theirs > 0 else math.inf

        spans = {arm: interval(n, functools.partial(mean_of, arm)) for arm in added}
        line = ", ".join(f"{arm} {statistics.fmean(added[arm]):+.2f} ms (95% interval {spans[arm][0]:+.2f} to "
                         f"{spans[arm][1]:+.2f})" for arm in added)
        print(f"  added a step, {what}: {line}")
        for arm in ("dpprof", "memory"):
            lo, hi = interval(n, functools.partial(share, arm))
            if spans["torch.profiler"][0] <= 0 or math.isinf(hi):
                print(f"  {arm} / torch.profiler, {what}: not measurable (torch.profiler's added time cannot be told "
                      "from zero)", flush=True)
            else:
                print(f"  {arm} / torch.profiler, {what}: {share(arm, list(range(n))):.2f} (95% interval {lo:.2f} to "
                      f"{hi:.2f}; aim for dpprof: <= 0.5)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=50)
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
           "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps),
           *(["--allow-load"] if args.allow_load else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPPROF_REPORTS": os.environ.get("DPPROF_REPORTS", "/tmp/dpprof-bench")}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
