"""Two optimizers stepped back to back after one backward, with no forward between them: the embedding under SGD and
the dense layers under Adam (a sparse embedding's usual set-up: SparseAdam or SGD for it, Adam for the rest; dense
here, for DataParallel's and gloo's sake). The dense optimizer's step sleeps --sleep-ms, so its time is known.

WRAP=dp: nn.DataParallel (dpprof run --cpu-workers N); WRAP=ddp: DistributedDataParallel on gloo, under torchrun.
Each rank prints, for each step, the time its two optimizer steps took together as the script measures it:
``rank R step S optimizers_ms X``.
"""
import argparse
import gc
import os
import sys
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--sleep-ms", type=float, default=40.0)
args = parser.parse_args()
WRAP = os.environ.get("WRAP", "dp")


class SleepyAdam(torch.optim.Adam):
    """Adam whose step also sleeps --sleep-ms (a slow optimizer of known length)."""

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(args.sleep_ms / 1000)
        return super().step(closure)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 16)
        self.dense = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dense(self.embedding(tokens).mean(1))


rank = 0
if WRAP == "ddp":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
torch.manual_seed(0)
net = Net()
model = nn.parallel.DistributedDataParallel(net) if WRAP == "ddp" else nn.DataParallel(net)
opt_embedding = torch.optim.SGD(net.embedding.parameters(), lr=0.1)
opt_dense = SleepyAdam(net.dense.parameters(), lr=1e-3)
batches = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    tokens, y = torch.randint(0, 100, (16, 6), generator=batches), torch.randint(0, 4, (16,), generator=batches)
    opt_embedding.zero_grad()
    opt_dense.zero_grad()
    loss = nn.functional.cross_entropy(model(tokens), y)
    loss.backward()
    t0 = time.perf_counter()
    opt_embedding.step()
    opt_dense.step()
    # one write of the whole line: print writes the text and its newline apart, and two ranks sharing torchrun's
    # stdout interleaved them ("32.775rank 1 step ...")
    sys.stdout.flush()
    os.write(1, f"rank {rank} step {step} optimizers_ms {(time.perf_counter() - t0) * 1000:.3f}\n".encode())
if WRAP == "ddp":
    del model  # DDP's gloo objects freed while the interpreter is whole (see train_ddp.py)
    gc.collect()
    dist.destroy_process_group()
