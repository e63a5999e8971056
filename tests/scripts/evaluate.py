"""Evaluation only: a DataParallel model in eval mode under no_grad (or torch.inference_mode with argument
'inference'), no optimizer."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.DataParallel(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))).eval()
correct = total = 0
with torch.inference_mode() if sys.argv[1:] == ["inference"] else torch.no_grad():
    for _ in range(5):
        x, y = torch.randn(20, 10), torch.randint(0, 3, (20,))
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
print(f"accuracy {correct / total:.4f}")
