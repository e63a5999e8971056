"""A DistributedDataParallel script for torchrun (gloo): each rank trains on its own batches."""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x, y = torch.randn(32, 20, generator=batches), torch.randint(0, 4, (32,), generator=batches)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
