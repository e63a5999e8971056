"""What each part of recording one DataParallel forward call costs on the calling thread, timed alone.

Each part runs in a loop by itself inside a run kept in memory (``dpprof.record(store=False)``),
on the MLP 64-128-128-10 over 2 CPU workers that bench/overhead.py uses:

- opening a forward call's probe (the step it belongs to, the devices it uses), inside ``run.step()``
  (the call joins the open step) and without it (the call closes the last step, with its record,
  and opens its own);
- one phase's torch.profiler range, timing and record (scatter, replicate, parallel_apply and
  gather each pay this once a call);
- the backward watch (a hook on the output: the dpprof.backward range and its timing);
- closing the call: two replicas' byte counts and their memory records;
- noting the batch and the gathered output;
- an empty ``run.step()`` block (it opens the step, and closes it with its record).

Each part is timed with the garbage collector off (see _us_per_call). The sums, with ``run.step()`` around the step and without it, are the floor of what recording adds
to the calling thread per step; bench/overhead.py measures what it adds inside real steps, where the
thread shares the cores with the workers. The step's own machinery is also timed as a whole, the two
ways alternated: ``run.step()`` with its forward call's step lookup, against the lookup of a forward
call that closes the last step and opens its own.

    python bench/record_parts.py [--calls 20000]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dpprof
from dpprof.parallel.data_parallel import _PhaseRange
from dpprof.parallel.probe import ForwardProbe, watch_backward


def _us_per_call(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn``, with the cyclic garbage collector off while timed: the run keeps
    its records in memory, so a full collection (~100 ms once 200,000 objects are alive) lands in
    whichever part happens to run then (it made an empty run.step() block read 8 us instead of 2)."""
    for _ in range(calls // 20):
        fn()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        gc.enable()


def _step_machinery(run: dpprof.recording.Run, calls: int, rounds: int = 40) -> tuple[float, float]:
    """(run.step() with one forward call's step lookup, a forward call's lookup that closes and opens an
    implicit step): medians of ``rounds`` alternated rounds, microseconds."""
    def explicit() -> None:
        with run.step():
            run.step_for_forward(True)

    def implicit() -> None:
        run.step_for_forward(True)

    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_us_per_call(explicit, calls // rounds * 4))
        theirs.append(_us_per_call(implicit, calls // rounds * 4))
    return statistics.median(ours), statistics.median(theirs)


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

        def probe_in_step() -> None:
            ForwardProbe(run, devices, "cpu:0", 0, True, root=model)

        def probe_in_step_loop(n: int) -> float:
            with run.step():  # every call joins this one step
                return _us_per_call(probe_in_step, n)

        # (name, times a step, which steps pay it: both, "explicit" (run.step()) or "implicit" (none), timing)
        parts = [
            ("opening a forward call's probe, inside run.step()", 1, "explicit", probe_in_step_loop),
            ("opening a forward call's probe, no run.step()", 1, "implicit",
             lambda n: _us_per_call(lambda: ForwardProbe(run, devices, "cpu:0", 0, True, root=model), n)),
            ("one phase's range, timing and record", 4, "both", lambda n: _us_per_call(phase, n)),
            # the watch registers a hook on the same tensor every call: fewer calls keep its hook list short
            ("the backward watch (registering it)", 1, "both",
             lambda n: _us_per_call(lambda: watch_backward(output, probe, "cpu:0"), n // 4)),
            ("closing the call (two replicas)", 1, "both", lambda n: _us_per_call(close, n)),
            ("noting the batch", 1, "both", lambda n: _us_per_call(lambda: probe.note_batch((x,), {}), n)),
            ("noting the gathered output", 1, "both", lambda n: _us_per_call(lambda: probe.note_gathered(out), n)),
            ("an empty run.step() block", 1, "explicit", lambda n: _us_per_call(step, n)),
        ]
        print(f"torch {torch.__version__}; microseconds per call, {args.calls} calls each")
        totals = {"explicit": 0.0, "implicit": 0.0}
        for name, per_step, paid_by, timing in parts:
            us = timing(args.calls)
            for kind in totals:
                if paid_by in ("both", kind):
                    totals[kind] += us * per_step
            times = f" (x{per_step} a call)" if per_step > 1 else ""
            print(f"  {name + times:55s} {us:6.2f} us")
        for kind, how in (("explicit", "in run.step()"), ("implicit", "without run.step()")):
            print(f"  {'per recorded step (one forward call), ' + how:55s} {totals[kind]:6.1f} us")
        print("  (before the replicas' own records on the workers and the backward's two callbacks)")
        ours, theirs = _step_machinery(run, args.calls)
        print(f"  the step's own machinery, alternated: run.step() and its forward's step {ours:.2f} us;"
              f" a forward closing the last step and opening its own {theirs:.2f} us")


if __name__ == "__main__":
    main()
