"""A DataParallel training loop that skips a bad batch, as loops that skip an out-of-memory batch do: the model's
forward checks its input and raises on a NaN (batch 3 has one), which the script catches (zero_grad, go on).
Arguments: --batches N (default 6), --save PATH (the trained weights)."""
import argparse

import torch
from torch import nn


class Checked(nn.Sequential):
    def forward(self, x):
        if not torch.isfinite(x).all():
            raise RuntimeError("a batch with a NaN")
        return super().forward(x)


parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=6)
parser.add_argument("--save", default=None)
args = parser.parse_args()
torch.manual_seed(0)
model = nn.DataParallel(Checked(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(args.batches):
    x = torch.randn(16, 8)
    if step == 3:
        x[0, 0] = float("nan")
    try:
        model(x).pow(2).mean().backward()
        optimizer.step()
        print(f"step {step} trained", flush=True)
    except RuntimeError:
        print(f"step {step} skipped", flush=True)
    optimizer.zero_grad()
if args.save:
    torch.save(model.module.state_dict(), args.save)
