"""What recording FSDP2 costs, against what torch.profiler adds: two gloo ranks on loopback.

Starts itself under torchrun (2 ranks). Each rank trains two models sharded with ``fully_shard`` (per layer and on
the root): an MLP and a small transformer encoder. Rounds interleave three arms in rotating order, in one process
so machine noise hits them alike: nothing recording ("off"), ``dpprof.record`` with dpprof.parallel.fsdp's hooks
("dpprof"), and ``torch.profiler.profile`` of the CPU activity ("torch.profiler"). Each arm's figure is the mean step
time over its blocks of ``--steps`` steps (the first block of each arm is a warm-up and left out); rank 0 prints the
time each recorder adds and the ratio of dpprof's to torch.profiler's. Aim: at most half of torch.profiler's.
Rank 0 also says the machine's load (bench/conditions.py: before, and while each model's rounds ran, the cores
taken by the two ranks and by every other process); where other processes took more than a quarter of a core, it
prints the arms' mean steps without the ratios (``--allow-load`` prints them anyway).

    python bench/fsdp_overhead.py [--rounds 8] [--steps 20] [--allow-load]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Any

from conditions import Conditions

ARMS = ("off", "dpprof", "torch.profiler")


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

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fsdp.install()
    torch.manual_seed(0)
    for name, (model, batch, layers) in _models(torch).items():
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)

        def block(n: int) -> tuple[float, float]:
            """Mean seconds per step over n steps, wall clock and this process's CPU time (all its threads)."""
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                optimizer.zero_grad(set_to_none=True)
                model(batch(gen)).float().pow(2).mean().backward()
                optimizer.step()
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

        def recorder(arm: str) -> Any:
            if arm == "dpprof":
                return dpprof.record(name=f"bench-fsdp-{name}", sample_hz=None)
            if arm == "torch.profiler":
                return profile(activities=[ProfilerActivity.CPU])
            return nullcontext()

        means: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
        conditions = Conditions(root=os.getppid())  # torchrun: both ranks are below it
        if rank == 0:
            conditions.__enter__()
        for r in range(args.rounds + 1):
            order = ARMS[r % 3:] + ARMS[:r % 3]
            for arm in order:
                with recorder(arm):
                    seconds, cpu_seconds = block(args.steps)
                if r > 0:  # the first round warms every arm up
                    means[arm].append(seconds)
                    cpu[arm].append(cpu_seconds)
        if rank == 0:
            conditions.__exit__(None, None, None)
            refused = None if args.allow_load else conditions.refusal()
            ms = {arm: statistics.mean(v) * 1e3 for arm, v in means.items()}
            cpu_ms = {arm: statistics.mean(v) * 1e3 for arm, v in cpu.items()}
            dp, tp = ms["dpprof"] - ms["off"], ms["torch.profiler"] - ms["off"]
            print(f"{name}: 2 gloo ranks, {args.rounds} rounds x {args.steps} steps per arm (mean ms per step)")
            for arm in ARMS:
                print(f"  {arm:15s} {ms[arm]:8.2f} ms/step")
            print(f"  {conditions.line()}")
            if refused:
                print(f"  ratios {refused}", flush=True)
                continue
            # a ratio to an added time that is not above zero says nothing: the rounds moved more than the profiler
            ratio = f"{dp / tp:.2f}" if tp > 0 else "not measurable (torch.profiler's added time is not above zero)"
            print(f"  dpprof adds {dp:+.2f} ms ({dp / ms['off']:+.1%}), torch.profiler {tp:+.2f} ms "
                  f"({tp / ms['off']:+.1%}); dpprof / torch.profiler = {ratio} (aim: <= 0.5)", flush=True)
            cdp, ctp = cpu_ms["dpprof"] - cpu_ms["off"], cpu_ms["torch.profiler"] - cpu_ms["off"]
            cpu_ratio = f"{cdp / ctp:.2f}" if ctp > 0 else "not measurable"
            print(f"  rank 0's CPU time per step: off {cpu_ms['off']:.2f} ms, dpprof {cdp:+.2f} ms, torch.profiler "
                  f"{ctp:+.2f} ms; ratio {cpu_ratio}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--allow-load", action="store_true",
                        help="report the ratios even where other processes took the processor during the run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps),
           *(["--allow-load"] if args.allow_load else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPPROF_REPORTS": os.environ.get("DPPROF_REPORTS", "/tmp/dpprof-bench")}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
