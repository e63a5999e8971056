"""A DistributedDataParallel loop recorded by ``dpprof.record`` on a gloo world of one (its store file in the
directory argv[1] names), which all-reduces a metric after each optimizer step three ways: by the name it imported at
its top (``from torch.distributed import all_reduce``, 16 bytes), through the module (``dist.all_reduce``, 32 bytes),
and by a name its training function bound before the first recorded forward (8 bytes)."""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import all_reduce

import dpprof


def train(steps: int) -> None:
    reduce_here = dist.all_reduce  # a local name, bound before the first recorded forward
    model = dpprof.DistributedDataParallel(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with dpprof.record(name="metric", sample_hz=None):
        for _ in range(steps):
            model(torch.randn(16, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(8))
            reduce_here(torch.ones(2))
    del model, optimizer


dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=0, world_size=1)
train(4)
dist.destroy_process_group()
