"""Which part of recording costs what inside real steps: the ``memory`` arm of bench/overhead.py (timing and memory
accounting into a run kept in memory, ``with run.step():`` around each step) with one part turned off at a time.

Arms, interleaved round by round in one process (the order rotates, and reverses every other round):

- off: dpprof.DataParallel, nothing recording;
- memory: everything recording does, into memory;
- memory - activations: no count of the bytes autograd saved (each replica's call runs as it is);
- and with ``--device cuda`` (cifar-lenet at batch 256 on GPU 0):
  - memory - allocator: no caching-allocator reads (at an apply's end and at backward's end);
  - memory - events: no CUDA timing events (phases keep their host times; with no events there are no allocator
    reads either: the difference from ``- allocator`` is the events' own cost);
  - memory - NVML: no NVML sampler thread (``sample_hz=0``).

Each part's cost is the full arm's added time less the arm without it, paired per round (medians of rounds, with
the middle half of the rounds). On a GPU the primitives each part calls are also timed alone on the calling
thread: a timing event recorded and read, one allocator read, a peak reset.

The parts are turned off by replacing dpprof's functions for the arm's block, so this measures the code as it is,
not a build of it: the figures recorded with a part off are not dpprof's and are thrown away.

    python bench/overhead_parts.py [--device cpu|cuda] [--rounds N] [--threads N] [--allow-load]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import dpprof
from dpprof.parallel import probe as probe_module

from conditions import Conditions
from overhead import _block, _cifar, _mlp, _on_gpu


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _no_activations(self: Any, fn: Callable[..., Any], weights: Any, args: Any, kwargs: dict[str, Any],
                    site: Any = None) -> tuple[Any, int]:
    return fn(*args, **kwargs), 0


def _part_off(part: str) -> Callable[[ExitStack], None]:
    def enter(stack: ExitStack) -> None:
        if part == "activations":
            stack.enter_context(_replaced(probe_module.ForwardProbe, "call_counting_activations", _no_activations))
        elif part == "allocator":
            stack.enter_context(_replaced(probe_module, "_ALLOCATOR_READS", {}))
        elif part == "events":
            stack.enter_context(_replaced(probe_module.ForwardProbe, "start_event", lambda self, label: None))
            stack.enter_context(_replaced(probe_module, "cuda_event", lambda index: None))
    return enter


def _us(fn: Callable[[], Any], calls: int = 2000) -> float:
    for _ in range(calls // 10):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def primitives() -> None:
    """Each CUDA primitive a recorded step calls, alone on the calling thread (GPU 0 idle but for it)."""
    torch.cuda.synchronize()
    x = torch.ones(1, device="cuda")

    def event_pair() -> None:
        a, b = probe_module.event_now(0), probe_module.event_now(0)
        b.synchronize()
        a.elapsed_time(b)
        probe_module._release_events(0, a, b)

    e = probe_module.event_now(0)
    e.synchronize()
    print("  alone on the calling thread, us a call:")
    for name, fn in (("perf_counter_ns", time.perf_counter_ns),
                     ("event_now (record one timing event)", lambda: probe_module._release_events(0, probe_module.event_now(0))),
                     ("event query (completed)", e.query),
                     ("two events recorded, waited for, elapsed_time, released", event_pair),
                     ("allocator_bytes (one allocator read)", lambda: probe_module.allocator_bytes(0)),
                     ("torch.cuda.memory_allocated", lambda: torch.cuda.memory_allocated(0)),
                     ("torch.cuda.reset_peak_memory_stats", lambda: torch.cuda.reset_peak_memory_stats(0)),
                     ("a 1-element add launched (for scale)", lambda: x.add_(1))):
        print(f"    {name:58s} {_us(fn):8.2f}")
    torch.cuda.synchronize()


# dpprof's functions on a recorded step's path, timed where they run (any thread): (owner, attribute, what it is).
# Times are inclusive: a function's time holds what it calls (finish_phase holds event_now and allocator_bytes).
_INSIDE = (
    ("recording.Run", "step_for_forward", "a forward call finds its step"),
    ("recording._StepBlock", "__enter__", "run.step() opens a step"),
    ("recording._StepBlock", "__exit__", "run.step() closes a step (holds resolve_pending)"),
    ("recording.Run", "resolve_pending", "CUDA timings read once complete"),
    ("probe.ForwardProbe", "__init__", "a forward call's probe"),
    ("probe.ForwardProbe", "start_event", "a phase's start event"),
    ("probe.ForwardProbe", "finish_phase", "a phase's end: time, event, allocator"),
    ("probe", "event_now", "one timing event recorded"),
    ("probe", "allocator_bytes", "one allocator read"),
    ("probe", "saved_bytes", "activation bytes counted from the graph"),
    ("probe.ForwardProbe", "end", "a call's memory records"),
    ("probe.ForwardProbe", "note_batch", "the batch noted"),
    ("probe.ForwardProbe", "watch_backward", "the backward hook set"),
    ("probe._PassWatch", "on_grad", "backward starts (hook)"),
    ("probe._PassWatch", "on_done", "backward ends (callback, holds finish_phase)"),
)


def inside(net: Any, step: Any, optimizer: Any, batches: Any, n: int) -> None:
    """Each function of _INSIDE timed where it runs, over one recorded block: microseconds a step and calls a step.
    The wrapper's own cost (two clock reads, ~0.3 us a call) is in each figure."""
    from dpprof import recording
    modules = {"recording": recording, "probe": probe_module}
    totals: dict[str, list[float]] = {}
    with ExitStack() as stack:
        for owner_path, attr, _ in _INSIDE:
            head, _, cls = owner_path.partition(".")
            owner = getattr(modules[head], cls) if cls else modules[head]
            fn = getattr(owner, attr)
            key = f"{owner_path}.{attr}"
            cell = totals[key] = [0.0, 0]

            def timed(*a: Any, _fn: Callable[..., Any] = fn, _cell: list[float] = cell, **k: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return _fn(*a, **k)
                finally:
                    _cell[0] += time.perf_counter_ns() - t0
                    _cell[1] += 1
            stack.enter_context(_replaced(owner, attr, timed))
        with dpprof.record(name="bench-inside", store=False) as r:
            _block(net, step, optimizer, batches, n, r)
            steps = n + max(2, n // 10)  # _block runs a tenth more, untimed, before its timed steps
            for cell in totals.values():
                cell[0], cell[1] = 0.0, 0
            wall, _, _, _ = _block(net, step, optimizer, batches, n, r)
    print(f"  inside dpprof, one recorded block of {n} steps ({wall / n * 1e3:.3f} ms a step with the wrappers):"
          " us a step (inclusive), calls a step")
    for (owner_path, attr, what), (key, (ns, calls)) in zip(_INSIDE, totals.items()):
        if calls:
            print(f"    {key:42s} {ns / steps / 1e3:8.1f} {calls / steps:6.1f}  {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the MLP on 2 CPU workers (default); cuda: cifar-lenet at batch 256 on GPU 0")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, help="the calling thread's intra-op threads (default: torch's own)")
    parser.add_argument("--allow-load", action="store_true", help="report the parts even under load")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2, got {args.rounds}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    step = _on_gpu(_cifar()) if cuda else _mlp()
    net = dpprof.DataParallel(step.model, device_ids=[0] if cuda else dpprof.cpu_devices(2))
    optimizer = torch.optim.SGD(step.model.parameters(), lr=0.01, momentum=0.9)
    batches = step.batches()
    n = step.block_steps
    parts = ["activations"] + (["allocator", "events", "NVML"] if cuda else [])

    def arm(part: str | None) -> Callable[[], tuple[float, float, float, float]]:
        def run() -> tuple[float, float, float, float]:
            with ExitStack() as stack:
                if part is not None and part != "NVML":
                    _part_off(part)(stack)
                with dpprof.record(name="bench-parts", store=False, sample_hz=0 if part == "NVML" else 10.0) as r:
                    return _block(net, step, optimizer, batches, n, r)
        return run

    runners = {"off": lambda: _block(net, step, optimizer, batches, n), "memory": arm(None),
               **{f"memory - {p}": arm(p) for p in parts}}
    where = f"GPU 0 ({torch.cuda.get_device_name(0)})" if cuda else "2 CPU workers"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; {step.name} on {where}:"
          f" {args.rounds} rounds x {n} steps per arm")
    for k in runners:
        runners[k]()  # warm-up
    out: dict[str, list[float]] = {k: [] for k in runners}
    caller: dict[str, list[float]] = {k: [] for k in runners}
    with Conditions() as conditions:
        for r in range(args.rounds):
            order = list(runners)[r % len(runners):] + list(runners)[:r % len(runners)]
            if r % 2:
                order.reverse()
            for k in order:
                steps_s, _, _, caller_s = runners[k]()
                gc.collect()
                out[k].append(steps_s / n)
                caller[k].append(caller_s / n)
    refused = None if args.allow_load else conditions.refusal()

    def added(k: str, base: str, field: dict[str, list[float]]) -> list[float]:
        return [(a - b) * 1e6 for a, b in zip(field[k], field[base])]

    def middle(values: list[float]) -> str:
        if len(values) < 4:
            return ""
        q1, _, q3 = statistics.quantiles(values, n=4)
        return f"[{q1:+.1f}, {q3:+.1f}]"

    print(f"  {'arm':24s} {'mean step':>10s} {'added us':>9s} {'caller CPU added':>17s}  added, middle half of rounds")
    for k in runners:
        mean_ms = statistics.fmean(out[k]) * 1e3
        if k == "off" or refused:
            print(f"  {k:24s} {mean_ms:8.3f}ms")
            continue
        a = added(k, "off", out)
        print(f"  {k:24s} {mean_ms:8.3f}ms {statistics.median(a):+9.1f} {statistics.median(added(k, 'off', caller)):+15.1f}"
              f"   {middle(a)}")
    if refused:
        print(f"  parts {refused}")
    else:
        print("  each part's cost (memory less the arm without it, us a step, median of rounds; caller CPU):")
        for p in parts:
            a = added("memory", f"memory - {p}", out)
            c = added("memory", f"memory - {p}", caller)
            print(f"    {p:20s} {statistics.median(a):+8.1f}  {middle(a):22s} caller CPU {statistics.median(c):+8.1f}")
    print(f"  {conditions.line()}")
    inside(net, step, optimizer, batches, n)
    if cuda:
        primitives()


if __name__ == "__main__":
    sys.exit(main())
