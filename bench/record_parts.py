"""What each part of recording one DataParallel forward call costs on the calling thread, timed alone.

Each part runs in a loop by itself inside a run kept in memory (``dpprof.record(store=False)``),
on the MLP 64-128-128-10 over 2 CPU workers that bench/overhead.py uses:

- opening a forward call's probe (the step it belongs to, the devices it uses);
- one phase's torch.profiler range, timing and record (scatter, replicate, parallel_apply and
  gather each pay this once a call);
- the backward watch (a hook on the output: the dpprof.backward range and its timing);
- closing the call: two replicas' byte counts and their memory records;
- noting the batch and the gathered output;
- an empty ``run.step()`` block (its step record).

The sum is the floor of what recording adds to the calling thread per step; bench/overhead.py
measures what it adds inside real steps, where the thread shares the cores with the workers.

    python bench/record_parts.py [--calls 20000]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dpprof
from dpprof.parallel.data_parallel import _PhaseRange
from dpprof.parallel.probe import ForwardProbe, watch_backward


def _us_per_call(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    net = dpprof.DataParallel(model, dpprof.cpu_devices(2))
    devices = net.__dict__["_devices"]
    x = torch.randn(64, 64)
    chunk, out = x[:32], torch.randn(32, 10)
    output = torch.randn(64, 10, requires_grad=True) * 2  # a non-leaf, as a gathered output is

    with dpprof.record(name="bench-record-parts", store=False) as run:
        probe = ForwardProbe(run, devices, "cpu:0", 0, True, root=model)

        def phase() -> None:
            r = _PhaseRange(probe, "scatter", "cpu:0")
            r.__enter__()
            r.__exit__(None, None, None)

        def close() -> None:
            probe.applied.append(("cpu:0", (chunk,), {}, out, 100, 0, True))
            probe.applied.append(("cpu:1", (chunk,), {}, out, 100, 0, True))
            probe.end(model)

        def step() -> None:
            with run.step():
                pass

        parts = [
            ("opening a forward call's probe", 1,
             lambda: ForwardProbe(run, devices, "cpu:0", 0, True, root=model)),
            ("one phase's range, timing and record", 4, phase),
            ("the backward watch (registering it)", 1, lambda: watch_backward(output, probe, "cpu:0")),
            ("closing the call (two replicas)", 1, close),
            ("noting the batch", 1, lambda: probe.note_batch((x,), {})),
            ("noting the gathered output", 1, lambda: probe.note_gathered(out)),
            ("an empty run.step() block", 1, step),
        ]
        print(f"torch {torch.__version__}; microseconds per call, {args.calls} calls each")
        total = 0.0
        for name, per_step, fn in parts:
            # the watch registers a hook on the same tensor every call: fewer calls keep its hook list short
            us = _us_per_call(fn, args.calls // 4 if "watch" in name else args.calls)
            total += us * per_step
            times = f" (x{per_step} a call)" if per_step > 1 else ""
            print(f"  {name + times:50s} {us:6.2f} us")
        print(f"  {'per recorded step (one forward call)':50s} {total:6.1f} us, before the replicas' own records"
              " on the workers and the backward's two callbacks")


if __name__ == "__main__":
    main()
