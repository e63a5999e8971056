"""A training loop that dies midway, as one does when its loss turns NaN."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.DataParallel(nn.Linear(8, 2))
optimizer = torch.optim.Adam(model.parameters())
for step in range(10):
    if step == 3:
        raise RuntimeError("loss is nan at step 3")
    loss = model(torch.randn(12, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}", flush=True)
