"""FSDP2 (fully_shard per layer and on the root) on gloo ranks: a small MLP, trained; unchanged for dpprof.

Run under torchrun. Environment: FSDP_STEPS (default 4), FSDP_RESHARD (1: reshard after forward, the default; 0:
keep the gathered parameters until backward), FSDP_PREFETCH (1: explicit forward and backward prefetching),
FSDP_OUT (a path: rank 0 saves the trained full state dict there), FSDP_WIDTH (hidden width, default 64),
FSDP_UNEVEN (1: add a 3-row table of 589,824 columns, its own fully_shard group: on 2 ranks its shards are 2 rows and 1),
FSDP_ACCUM (micro-batches per optimizer step, default 1: gradients reduce-scattered on the last alone, through
set_requires_gradient_sync; with FSDP_KEEP_GATHERED=1 the micro-batches before the last also keep their parameters
gathered after backward, set_reshard_after_backward(False)), FSDP_NAN_AT (a step: every rank's batch of it has a NaN,
which the model's forward raises on; the script catches it, recovers FSDP with reset_iter_state() and skips the batch),
FSDP_VIEW (1: each layer and the root return a view of their output, which FSDP2 warns of).
"""
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
width = int(os.environ.get("FSDP_WIDTH", "64"))


class Rows(torch.nn.Module):
    """Its input as rows: a view."""

    def forward(self, x):
        return x.view(len(x), -1)


views = [Rows()] if os.environ.get("FSDP_VIEW") == "1" else []
layers = [torch.nn.Sequential(torch.nn.Linear(width if i else 20, width), torch.nn.ReLU(), *views) for i in range(3)]
UNEVEN_COLUMNS = 589_824  # one row is 2.25 MiB: over dpprof's memory floor (2 MiB)


class Offset(torch.nn.Module):
    """Adds the mean of a 3-row table to its input: a parameter whose dim 0 does not divide by 2 ranks."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(3, UNEVEN_COLUMNS))

    def forward(self, x):
        return x + self.table.mean()


class Checked(torch.nn.Sequential):
    def forward(self, x):
        if not torch.isfinite(x).all():
            raise RuntimeError("a batch with a NaN")
        return super().forward(x)


if os.environ.get("FSDP_UNEVEN") == "1":
    layers.append(Offset())
model = Checked(*layers, torch.nn.Linear(width, 7), *views)
reshard = os.environ.get("FSDP_RESHARD", "1") == "1"
for layer in layers:
    fully_shard(layer, reshard_after_forward=reshard)
fully_shard(model, reshard_after_forward=reshard)
if os.environ.get("FSDP_PREFETCH") == "1":
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1 + rank)
accum = int(os.environ.get("FSDP_ACCUM", "1"))
nan_at = int(os.environ.get("FSDP_NAN_AT", "-1"))
for step in range(int(os.environ.get("FSDP_STEPS", "4"))):
    for micro in range(accum):
        if accum > 1:
            model.set_requires_gradient_sync(micro == accum - 1)
            if os.environ.get("FSDP_KEEP_GATHERED") == "1":
                model.set_reshard_after_backward(micro == accum - 1)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 7, (16,), generator=g)
        if step == nan_at:
            x[0, 0] = float("nan")
        try:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        except RuntimeError:
            model.reset_iter_state()  # FSDP2's recovery from a forward that raised
            break
        loss.backward()
    else:
        opt.step()
    opt.zero_grad()
state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
if rank == 0 and os.environ.get("FSDP_OUT"):
    torch.save(state, os.environ["FSDP_OUT"])
# The gloo objects these globals hold (DDP's reducer, FSDP's state) abort the process now and then when the
# interpreter frees them at its exit ("terminate called without an active exception"; pytorch/pytorch#179291):
# 1 of 20 runs of this script ended so. Freed here, while the interpreter is whole.
del model, layers, layer, opt, loss, state
gc.collect()
dist.destroy_process_group()
