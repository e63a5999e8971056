"""What recording costs in the garbage collector's collections over a long run: the periodic work a block bench hides.

bench/overhead.py collects the garbage after every block of a few hundred steps, so no block pays for a full
collection of the process (every object torch and the script hold, about 200 ms here). A long recording does: the
objects a step leaves behind for the writer, if they live through collections, are moved into the collector's
oldest generation, and its growth sets off full collections. This bench records long blocks of the MLP
64-128-128-10 at batch 64 on 2 CPU workers (``with run.step():``, into a run file) beside blocks with nothing
recording, in alternating order, with no collection between them, and counts every collection and its time
(``gc.callbacks``) per generation. It prints, per arm, the collections and their milliseconds per 1,000 steps and
the mean step, and what recording adds in collections a step: the figure a long run pays on top of bench/overhead's.

    python bench/gc_cost.py [--steps 5000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dpprof  # noqa: E402

from conditions import Conditions  # noqa: E402
from overhead import _mlp, _steps  # noqa: E402

ARMS = ("off", "dpprof")


class Collections:
    """Every collection of the garbage collector while entered: how many per generation and their seconds."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000, help="steps per block (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per arm (default 3)")
    parser.add_argument("--allow-load", action="store_true", help="report the figures even under load")
    args = parser.parse_args()
    mlp = _mlp()  # bench/overhead.py's step
    net = dpprof.DataParallel(mlp.model, device_ids=dpprof.cpu_devices(2))
    optimizer = torch.optim.SGD(mlp.model.parameters(), lr=0.01, momentum=0.9)
    batches = mlp.batches()
    reports = tempfile.mkdtemp(prefix="dpprof-gc-")

    def steps(n: int, run: Any = None) -> None:
        _steps(net, mlp, optimizer, batches, n, run)

    steps(200)
    print(f"torch {torch.__version__}; {len(gc.get_objects())} objects tracked by the collector; blocks of "
          f"{args.steps} steps, {args.rounds} per arm, no collection forced between them")
    out: dict[str, list[tuple[float, Collections]]] = {arm: [] for arm in ARMS}
    with Conditions() as conditions:
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                recording = dpprof.record(name="gc", reports_dir=reports, sample_hz=None) if arm == "dpprof" \
                    else nullcontext()
                with recording as run, Collections() as seen:
                    t0 = time.perf_counter()
                    steps(args.steps, run)
                    out[arm].append(((time.perf_counter() - t0) / args.steps, seen))
    per_k = 1000 / args.steps
    for arm in ARMS:
        blocks = out[arm]
        counts = [statistics.fmean(c.count[g] for _, c in blocks) * per_k for g in range(3)]
        ms = [statistics.fmean(c.seconds[g] for _, c in blocks) * 1e3 * per_k for g in range(3)]
        step_us = statistics.fmean(s for s, _ in blocks) * 1e6
        print(f"  {arm:7s} mean step {step_us:7.1f} us; per 1,000 steps: collections {counts[0]:.1f} / {counts[1]:.2f}"
              f" / {counts[2]:.2f} (generations 0 / 1 / 2) taking {sum(ms):.2f} ms (of it full collections"
              f" {ms[2]:.2f} ms)")
    print(f"  {conditions.line()}")
    refused = None if args.allow_load else conditions.refusal()
    if refused:
        print(f"  figures {refused}")
        return
    added = [statistics.fmean(sum(c.seconds) for _, c in out[arm]) / args.steps * 1e6 for arm in ARMS]
    print(f"  recording adds {added[1] - added[0]:+.1f} us a step in collections over a long run "
          f"({added[0]:.1f} us off, {added[1]:.1f} us recording)")


if __name__ == "__main__":
    main()
