"""What `dpprof run` costs a script: recording on against the same command with recording off.

Both arms run `python -m dpprof run --cpu-workers 2 bench/train_cifar.py` (the CIFAR-10 Net,
batch 256, on 2 CPU workers: torch.nn.DataParallel is dpprof's in both); the "off" arm adds
--no-record. Arms alternate process by process, in one run, so machine noise hits them alike.
Prints each arm's median step time (the script's own per-step times, warm-up steps left out),
the median over rounds of each round's on/off ratio and the mean over rounds, and each
process's wall and CPU time (start-up, the run file, and at close the findings included; CPU
time is what the work costs whoever else shares the machine). Runs with OMP_NUM_THREADS=1 unless
it is set: two CPU workers on a small machine, one intra-op thread each.

Then the same comparison in this one process, where process start-up and the machine's other
load between processes do not enter: `dpprof run` (the CLI's main) on the script, recording on
and off in alternate blocks, each block's steps timed by the script and its CPU time (all threads)
by this process.

    python bench/run_overhead.py [--rounds 8] [--steps 60] [--warmup 5] [--blocks 20] [--block-steps 25]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_cifar.py")
ROOT = Path(__file__).resolve().parent.parent


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _arm(record: bool, steps: int, reports: str) -> tuple[list[float], float, float]:
    """One process: the script's per-step milliseconds, the process's wall and CPU seconds."""
    cmd = [sys.executable, "-m", "dpprof", "run", "--cpu-workers", "2", *([] if record else ["--no-record"]),
           str(SCRIPT), "--steps", str(steps)]
    env = {**os.environ, "DPPROF_REPORTS": reports, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0, c0 = time.perf_counter(), _children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")], wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="steps per process")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each process left out")
    parser.add_argument("--blocks", type=int, default=20, help="in-process blocks per arm")
    parser.add_argument("--block-steps", type=int, default=25, help="steps per in-process block")
    args = parser.parse_args()

    steps: dict[str, list[float]] = {"off": [], "on": []}
    walls: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    ratios, wall_diffs, cpu_diffs = [], [], []
    with tempfile.TemporaryDirectory() as reports:
        for r in range(args.rounds):
            medians = {}
            for arm in (["off", "on"] if r % 2 == 0 else ["on", "off"]):  # neither always first
                times, wall, cpu = _arm(arm == "on", args.steps, reports)
                kept = times[args.warmup:]
                steps[arm] += kept
                walls[arm].append(wall)
                cpus[arm].append(cpu)
                medians[arm] = statistics.median(kept)
            ratios.append(medians["on"] / medians["off"])
            wall_diffs.append(walls["on"][-1] - walls["off"][-1])
            cpu_diffs.append(cpus["on"][-1] - cpus["off"][-1])
        recorded = len(list(Path(reports).glob("*.sqlite")))
    print(f"dpprof run --cpu-workers 2 bench/train_cifar.py: {args.rounds} rounds x {args.steps} steps per arm "
          f"({args.warmup} warm-up steps left out), {recorded} runs recorded")
    for arm in steps:
        print(f"  recording {arm:3s}  {statistics.median(steps[arm]):8.2f} ms/step (median)   "
              f"process {statistics.median(walls[arm]):6.2f} s wall, {statistics.median(cpus[arm]):6.2f} s CPU (medians)")
    print(f"  recording adds {statistics.median(ratios) - 1:+.2%} per step (median of the rounds' ratios), "
          f"{statistics.mean(ratios) - 1:+.2%} (mean); rounds: "
          + ", ".join(f"{x - 1:+.1%}" for x in ratios))
    print(f"  per process, recording on less off (median over rounds): {statistics.median(wall_diffs) * 1e3:+.0f} ms "
          f"wall, {statistics.median(cpu_diffs) * 1e3:+.0f} ms CPU ({statistics.median(cpu_diffs) / args.steps * 1e3:+.2f} "
          "ms CPU per step if it were all per-step work; it includes creating the run file and, at close, the findings)")
    _in_process(args)


def _in_process(args: argparse.Namespace) -> None:
    import contextlib
    import io

    import torch

    from dpprof.cli import main as dpprof_main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps: dict[str, list[float]] = {"off": [], "on": []}
    cpu_per_step: dict[str, list[float]] = {"off": [], "on": []}
    ratios, cpu_ratios = [], []
    with tempfile.TemporaryDirectory() as reports:
        def block(record: bool) -> tuple[list[float], float]:
            out = io.StringIO()
            argv = ["--reports-dir", reports, "run", "--cpu-workers", "2", *([] if record else ["--no-record"]),
                    str(SCRIPT), "--steps", str(args.block_steps)]
            c0 = time.process_time()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                assert dpprof_main(argv) == 0
            cpu = time.process_time() - c0
            return [float(line.split()[-1]) for line in out.getvalue().splitlines() if line.startswith("step ")], cpu

        block(False)  # warm-up
        for r in range(args.blocks):
            medians, cpus = {}, {}
            for arm in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                times, cpu = block(arm == "on")
                steps[arm] += times[2:]
                medians[arm] = statistics.median(times[2:])
                cpus[arm] = cpu / args.block_steps
                cpu_per_step[arm].append(cpus[arm])
            ratios.append(medians["on"] / medians["off"])
            cpu_ratios.append(cpus["on"] / cpus["off"])
    print(f"in one process: {args.blocks} blocks x {args.block_steps} steps per arm, alternating")
    for arm in steps:
        print(f"  recording {arm:3s}  {statistics.median(steps[arm]):8.2f} ms/step (median)   "
              f"{statistics.median(cpu_per_step[arm]) * 1e3:7.2f} ms CPU per step, the block's start and close included")
    print(f"  recording adds {statistics.median(ratios) - 1:+.2%} per step (median of the blocks' ratios), "
          f"{statistics.mean(ratios) - 1:+.2%} (mean)")
    print(f"  and {statistics.median(cpu_ratios) - 1:+.2%} CPU per step (median), "
          f"{statistics.mean(cpu_ratios) - 1:+.2%} (mean)")


if __name__ == "__main__":
    main()
