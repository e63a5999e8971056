"""Real torch.profiler traces of CPU-only processes, made here for tests: a tiny model trained under
DistributedDataParallel (or sharded by FSDP2's ``fully_shard``) on gloo ranks (torch.multiprocessing), each rank profiled with a schedule (so its
steps are ProfilerStep#N ranges) and exported with ``prof.export_chrome_trace``, and one plain process with
no torch.distributed at all (training, or an inference loop: steps with neither a forward range nor backward)."""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

__all__ = ["gloo_ddp_traces", "fsdp_traces", "single_process_trace", "optimizer_in_backward_trace", "inference_trace",
           "leave_rank"]


def leave_rank() -> None:
    """End a helper rank whose trace is written, its group destroyed, without the interpreter's shutdown: there,
    torch's gloo groups abort the process now and then ("terminate called without an active exception": gloo's
    threads still hold tensors the finalizing interpreter frees, as pytorch/pytorch#179291 describes), 1 job in 16
    of these here, which mp.spawn reports as a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(model: nn.Module, steps: int, out: Path, delay_s: float = 0.0, width: int = 64) -> None:
    """``steps`` profiled steps (after one warm-up), each sleeping ``delay_s`` before its forward (a straggler)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the trace is written when the schedule's cycle ends, as torch.profiler.tensorboard_trace_handler does
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(steps + 1):
            if delay_s:
                time.sleep(delay_s)
            loss = model(torch.randn(32, width)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()


def _net(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 10))


def _rank(rank: int, world: int, port: int, directory: str, stem: str, steps: int, delay: tuple[int, float],
          fsdp: bool, width: int, bucket_cap_mb: float | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            model = _net(width)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(
                _net(width), **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}))
        _train(model, steps, Path(directory) / f"{stem}-rank{rank}.pt.trace.json",
               delay[1] if rank == delay[0] else 0.0, width)
    finally:
        dist.destroy_process_group()
    leave_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_ddp_traces(directory: Path, stem: str = "tinyddp", steps: int = 3, world: int = 2,
                    delay: tuple[int, float] = (-1, 0.0), width: int = 64,
                    bucket_cap_mb: float | None = None) -> list[Path]:
    """Each rank's trace of a DDP job on ``world`` gloo ranks, ``steps`` profiled steps: the files, by rank.
    ``delay``: (rank, seconds) that rank sleeps before every forward (a straggler); ``width``: the model's input;
    ``bucket_cap_mb``: DDP's (None: its default; a tiny one puts each parameter in a bucket of its own from the
    second step on)."""
    directory.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(world, _free_port(), str(directory), stem, steps, delay, False, width, bucket_cap_mb),
             nprocs=world, join=True)
    return [directory / f"{stem}-rank{r}.pt.trace.json" for r in range(world)]


def fsdp_traces(directory: Path, stem: str = "tinyfsdp", steps: int = 3, world: int = 2,
                delay: tuple[int, float] = (-1, 0.0), width: int = 64) -> list[Path]:
    """Each rank's trace of an FSDP2 job (``fully_shard`` on each Linear and on the root) on ``world`` gloo ranks,
    ``steps`` profiled steps: the files, by rank. ``delay`` and ``width`` as for gloo_ddp_traces."""
    directory.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(world, _free_port(), str(directory), stem, steps, delay, True, width), nprocs=world,
             join=True)
    return [directory / f"{stem}-rank{r}.pt.trace.json" for r in range(world)]


def single_process_trace(directory: Path, stem: str = "tinycpu", steps: int = 1) -> Path:
    """A trace of one CPU process with no torch.distributed, ``steps`` profiled steps."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{stem}.pt.trace.json"
    _train(_net(), steps, out)
    return out


class _SteadyAdam(torch.optim.Adam):
    """Adam whose step also takes 0.3 ms of its own (a sleep, inside torch's ``Optimizer.step#`` range): a step's
    optimizer ranges well over a millisecond on any machine (a fast one ran this model's four steps in 0.45 ms, under
    show's 0.5 ms floor for an overlap)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        time.sleep(0.0003)
        return super().step(closure)


def optimizer_in_backward_trace(directory: Path, stem: str = "tinyoib", steps: int = 3) -> Path:
    """A trace of one CPU process whose optimizer steps inside backward (PyTorch's optimizer-in-backward recipe:
    each parameter's own optimizer, stepped by ``register_post_accumulate_grad_hook``), ``steps`` profiled steps."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{stem}.pt.trace.json"
    model = _net()
    optimizers = {p: _SteadyAdam([p], lr=0.01) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(out))) as prof:
        for _ in range(steps + 1):
            model(torch.randn(32, 64)).sum().backward()
            prof.step()
    return out


def inference_trace(directory: Path, stem: str = "tinyinfer", steps: int = 3) -> Path:
    """A trace of one CPU process running its model under torch.no_grad: steps with no DataParallel or
    DistributedDataParallel forward range and no backward op."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{stem}.pt.trace.json"
    net = _net()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU],
                                  schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                  on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(steps + 1):
            net(torch.randn(32, 64))
            prof.step()
    return out
