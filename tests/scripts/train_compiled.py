"""A torch.compile'd nn.DataParallel (the aot_eager backend: no C++ compiler needed) trained 6 steps, its weights
saved to argv[1]. Dynamo's error_on_recompile is on: a frame compiled again (a guard on state that changes every
step) fails the script."""
import sys

import torch
import torch._dynamo
from torch import nn

torch._dynamo.config.error_on_recompile = True
torch.manual_seed(0)
dp = nn.DataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
model = torch.compile(dp, backend="aot_eager")
optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
batches = torch.Generator().manual_seed(1)
for _ in range(6):
    optimizer.zero_grad()
    model(torch.randn(10, 8, generator=batches)).pow(2).mean().backward()
    optimizer.step()
torch.save(dp.state_dict(), sys.argv[1])
