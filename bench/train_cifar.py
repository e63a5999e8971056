"""A training script as users write it (the 60-minute blitz's CIFAR-10 Net in nn.DataParallel, SGD,
synthetic CIFAR-shaped batches): no dpprof in it. Prints each step's wall time, as many scripts do.

    python bench/train_cifar.py [--steps 30] [--batch-size 256]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=256)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.DataParallel(Net())
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
for step in range(args.steps):
    inputs = torch.rand(args.batch_size, 3, 32, 32) * 2 - 1
    labels = torch.randint(0, 10, (args.batch_size,))
    t0 = time.perf_counter()
    optimizer.zero_grad()
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
    print(f"step {step} ms {(time.perf_counter() - t0) * 1e3:.3f}", flush=True)
