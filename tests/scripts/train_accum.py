"""A plain training loop as many repositories write it: nn.DataParallel, a DataLoader, SGD with
momentum, gradient accumulation every --accumulate batches. Prints the loss of every optimizer step."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=8)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--save", default=None, help="save the final weights here")
args = parser.parse_args()

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(args.batches * 16, 20), torch.randint(0, 4, (args.batches * 16,)))
loader = DataLoader(data, batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
model = nn.DataParallel(model).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
criterion = nn.CrossEntropyLoss()

step = 0
for i, (x, y) in enumerate(loader):
    loss = criterion(model(x.to(device)), y.to(device)) / args.accumulate
    loss.backward()
    if (i + 1) % args.accumulate == 0:
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item() * args.accumulate:.6f}")
        step += 1

if args.save:
    torch.save(model.module.state_dict(), args.save)
