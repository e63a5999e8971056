"""DDP with uneven inputs under the Join context manager: rank 0 trains on EXTRA more batches than the others, which
join early and shadow its all-reduces. Run under torchrun (gloo); unchanged for dpprof. Environment: BASE (6), EXTRA
(3)."""
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batches = int(os.environ.get("BASE", "6")) + (int(os.environ.get("EXTRA", "3")) if rank == 0 else 0)
data = torch.Generator().manual_seed(rank)
with Join([model]):
    for _ in range(batches):
        loss = model(torch.randn(20, 10, generator=data)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(f"rank {rank} trained on {batches} batches", flush=True)
# gloo objects freed while the interpreter is whole (pytorch/pytorch#179291: freed at exit, they abort now and then)
del model, optimizer, loss
gc.collect()
dist.destroy_process_group()
