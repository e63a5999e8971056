"""CPU torch.profiler traces made here for the detail views' and findings' tests, each with a condition really
produced: a loop whose DataLoader dominates the step (profiled with record_shapes, profile_memory, with_stack and
with_modules), and a 2-rank gloo DDP job whose rank 1 does extra matrix products in its forward (a straggler)."""
from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, Dataset

from cpu_traces import _free_port, leave_rank

__all__ = ["SlowSet", "slow_loader_trace", "straggler_ddp_traces", "with_gpu_memory"]

LOADER_SLEEP_S = 0.004  # per sample: 8 samples a batch, about 32 ms of loading against about 1 ms of compute


class SlowSet(Dataset):
    def __len__(self) -> int:
        return 1_000

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(LOADER_SLEEP_S)  # decoding a file, as a real input pipeline does
        return torch.randn(64)


def slow_loader_trace(directory: Path, steps: int = 5, num_workers: int = 0) -> Path:
    """One CPU process whose batches come from a DataLoader (without workers unless ``num_workers``), each sample
    taking LOADER_SLEEP_S: loading dominates every step (two workers halve it, still 16 ms against 1 ms)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"slowloader{num_workers or ''}.pt.trace.json"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = iter(DataLoader(SlowSet(), batch_size=8, num_workers=num_workers))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True,
                 with_modules=True, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for x in batches:
            loss = net(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
            if prof.step_num > steps:
                break
    return out


class _Uneven(nn.Module):
    """The same model on every rank; rank 1's forward also multiplies a 384x384 matrix by itself 6 times."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.rank = rank
        self.extra = torch.randn(384, 384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            y = self.extra
            for _ in range(6):
                y = torch.mm(y, self.extra) / 384
            x = x + y[: x.shape[0], : x.shape[1]].sum() * 0
        return self.net(x)


def _rank(rank: int, world: int, port: int, directory: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.parallel.DistributedDataParallel(_Uneven(rank))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        out = Path(directory) / f"straggler-rank{rank}.pt.trace.json"
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
            for _ in range(steps + 1):
                loss = model(torch.randn(32, 64)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                prof.step()
    finally:
        dist.destroy_process_group()
    leave_rank()


def straggler_ddp_traces(directory: Path, steps: int = 16) -> list[Path]:
    """Each rank's trace of a 2-rank gloo DDP job in which rank 1 does extra work in its forward: 16 steps, so that
    a few steps on a loaded machine where rank 0 was the one held up (its core taken by other work) leave rank 1
    the rank that waited least in most of them, more than chance would (10 of 15), as the straggler rule needs."""
    directory.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(2, _free_port(), str(directory), steps), nprocs=2, join=True)
    return [directory / f"straggler-rank{r}.pt.trace.json" for r in range(2)]


def with_gpu_memory(source: Path, out: Path, total_bytes: int) -> Path:
    """A copy of a real trace whose deviceProperties give every GPU ``total_bytes`` of memory (a smaller GPU), the
    events unchanged: the same peak against a smaller capacity."""
    with gzip.open(source, "rt") as f:
        doc = json.load(f)
    for props in doc.get("deviceProperties") or []:
        props["totalGlobalMem"] = total_bytes
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return out
