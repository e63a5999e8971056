"""A training loop that dies midway, as one does when its loss turns NaN (or, with argument 'forward', when its
model's forward raises on a batch of the wrong width, uncaught)."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.DataParallel(nn.Linear(8, 2))
optimizer = torch.optim.Adam(model.parameters())
for step in range(10):
    if step == 3 and sys.argv[1:] != ["forward"]:
        raise RuntimeError("loss is nan at step 3")
    loss = model(torch.randn(12, 8 if step != 3 else 9)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}", flush=True)
