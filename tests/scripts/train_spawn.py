"""Trains in processes of its own started with torch.multiprocessing.spawn (the DDP tutorial's way; no process
group here, so no gloo teardown can abort a rank): what they build is out of `dpprof run`'s reach."""
import torch
import torch.multiprocessing as mp
from torch import nn


def train(rank: int) -> None:
    torch.manual_seed(rank)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    print(f"rank {rank} trained", flush=True)


if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
