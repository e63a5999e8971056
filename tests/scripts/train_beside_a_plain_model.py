"""nn.DataParallel trained beside a plain module of its own optimizer (not recorded: no DataParallel), each iteration
after loading its batch (a sleep of --load-ms): the plain model's optimizer step comes after the DataParallel's,
with no recorded forward between."""
import argparse
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--load-ms", type=float, default=30.0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.DataParallel(nn.Linear(8, 4))
plain = nn.Linear(8, 4)
optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
for step in range(args.steps):
    time.sleep(args.load_ms / 1000)  # loading the batch
    plain(torch.randn(8, 8)).sum().backward()
    plain_optimizer.step()
    model(torch.randn(8, 8)).sum().backward()
    optimizer.step()
