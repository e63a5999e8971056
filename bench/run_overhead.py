"""What `dpprof run` costs a script: recording on against the same command with recording off.

Both arms run `python -m dpprof run --cpu-workers 2 bench/train_cifar.py` (the CIFAR-10 Net,
batch 256, on 2 CPU workers: torch.nn.DataParallel is dpprof's in both); the "off" arm adds
--no-record. Arms alternate process by process, in one run, so machine noise hits them alike.
Prints each arm's median step time (the script's own per-step times, warm-up steps left out),
the median over rounds of each round's on/off ratio and the mean over rounds, and each
process's wall time (start-up, the run file, and at close the findings included).

    python bench/run_overhead.py [--rounds 6] [--steps 40] [--warmup 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_cifar.py")
ROOT = Path(__file__).resolve().parent.parent


def _arm(record: bool, steps: int, reports: str) -> tuple[list[float], float]:
    """One process: the script's per-step milliseconds and the process's wall seconds."""
    cmd = [sys.executable, "-m", "dpprof", "run", "--cpu-workers", "2", *([] if record else ["--no-record"]),
           str(SCRIPT), "--steps", str(steps)]
    env = {**os.environ, "DPPROF_REPORTS": reports, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40, help="steps per process")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each process left out")
    args = parser.parse_args()

    steps: dict[str, list[float]] = {"off": [], "on": []}
    walls: dict[str, list[float]] = {"off": [], "on": []}
    ratios, wall_diffs = [], []
    with tempfile.TemporaryDirectory() as reports:
        for r in range(args.rounds):
            medians = {}
            for arm in (["off", "on"] if r % 2 == 0 else ["on", "off"]):  # neither always first
                times, wall = _arm(arm == "on", args.steps, reports)
                kept = times[args.warmup:]
                steps[arm] += kept
                walls[arm].append(wall)
                medians[arm] = statistics.median(kept)
            ratios.append(medians["on"] / medians["off"])
            wall_diffs.append(walls["on"][-1] - walls["off"][-1])
        recorded = len(list(Path(reports).glob("*.sqlite")))
    print(f"dpprof run --cpu-workers 2 bench/train_cifar.py: {args.rounds} rounds x {args.steps} steps per arm "
          f"({args.warmup} warm-up steps left out), {recorded} runs recorded")
    for arm in steps:
        print(f"  recording {arm:3s}  {statistics.median(steps[arm]):8.2f} ms/step (median)   "
              f"process {statistics.median(walls[arm]):6.2f} s (median)")
    print(f"  recording adds {statistics.median(ratios) - 1:+.2%} per step (median of the rounds' ratios), "
          f"{statistics.mean(ratios) - 1:+.2%} (mean); rounds: "
          + ", ".join(f"{x - 1:+.1%}" for x in ratios))
    print(f"  and {statistics.median(wall_diffs) * 1e3:+.0f} ms per process (median; the run file, the GPU "
          "check, and at close the findings)")


if __name__ == "__main__":
    main()
