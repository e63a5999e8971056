"""The loss computed inside the model's forward, as many repositories do to balance DataParallel's memory: each
replica returns its scalar loss, gathered into a vector (torch warns that it unsqueezed scalars) that the script
averages. Prints the loss of every step."""
import torch
from torch import nn


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 4))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


torch.manual_seed(0)
model = nn.DataParallel(WithLoss())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x, y = torch.randn(14, 10), torch.randint(0, 4, (14,))
    loss = model(x, y).mean()  # the line torch's warning names
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
