"""Gradient accumulation and an evaluation pass, as training scripts write them: DDP, FSDP2 or FSDP1 on gloo ranks;
unchanged for dpprof. Run under torchrun.

Each epoch: STEPS optimizer steps of ACCUM micro-batches each (DDP: no_sync() on all but the last; FSDP2:
set_requires_gradient_sync(False) likewise; FSDP1: no_sync()), then EVAL batches under torch.no_grad(). Rank 0
prints one line per optimizer step and per evaluation batch, and saves the trained weights to OUT when given.

Environment: WRAP (ddp, fsdp2, fsdp1; default ddp), EPOCHS (2), STEPS (3), ACCUM (3), EVAL (2), OUT,
OUTPUT (tensor, or dataclass: the model returns its logits in a dataclass), IMPORT (public, or composable: FSDP2's
fully_shard imported from torch.distributed._composable.fsdp), MP (bf16: FSDP2 gathers its parameters in bfloat16),
SLOW (RANK:MS: that rank sleeps MS before each optimizer step's first micro-batch, a slow data loader),
EVAL_SHORT (RANK: that rank's evaluation batches are one sample short, as ranks evaluating their shards of a set that
does not divide among them).
"""
import contextlib
import dataclasses
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn

WRAP = os.environ.get("WRAP", "ddp")
EPOCHS, STEPS = int(os.environ.get("EPOCHS", "2")), int(os.environ.get("STEPS", "3"))
ACCUM, EVAL = int(os.environ.get("ACCUM", "3")), int(os.environ.get("EVAL", "2"))
SLOW_RANK, SLOW_MS = (int(v) for v in os.environ.get("SLOW", "-1:0").split(":"))
EVAL_SHORT = int(os.environ.get("EVAL_SHORT", "-1"))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(20 if i == 0 else 48, 48), nn.ReLU()) for i in range(3)])
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return Output(logits) if os.environ.get("OUTPUT") == "dataclass" else logits


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = Net()
if WRAP == "ddp":
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(net)

    def sync(wrapped, last):
        return contextlib.nullcontext() if last else wrapped.no_sync()
elif WRAP == "fsdp2":
    if os.environ.get("IMPORT") == "composable":
        from torch.distributed._composable.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    policy = {}
    if os.environ.get("MP") == "bf16":  # parameters gathered in bfloat16
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for layer in net.layers:
        fully_shard(layer, **policy)
    del layer  # a global left holding an FSDP module keeps the process group to the interpreter's end
    model = fully_shard(net, **policy)

    @contextlib.contextmanager
    def sync(wrapped, last):
        wrapped.set_requires_gradient_sync(last)
        yield
else:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), use_orig_params=True,
                                     device_id=torch.device("cpu"))

    def sync(wrapped, last):
        return contextlib.nullcontext() if last else wrapped.no_sync()

optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(1 + rank)


def logits_of(output):
    return output.logits if isinstance(output, Output) else output


for epoch in range(EPOCHS):
    model.train()
    for step in range(STEPS):
        if rank == SLOW_RANK:
            time.sleep(SLOW_MS / 1e3)
        for micro in range(ACCUM):
            x, y = torch.randn(8, 20, generator=data), torch.randint(0, 5, (8,), generator=data)
            with sync(model, micro == ACCUM - 1):
                loss = nn.functional.cross_entropy(logits_of(model(x)), y) / ACCUM
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.6f}", flush=True)
    model.eval()
    with torch.no_grad():
        for i in range(EVAL):
            mean = logits_of(model(torch.randn(12 - (rank == EVAL_SHORT), 20, generator=data))).mean().item()
            if rank == 0:
                print(f"epoch {epoch} eval {i} mean {mean:.6f}", flush=True)

if WRAP == "fsdp1":
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                  FullStateDictConfig(rank0_only=True)):
        state = model.state_dict()
else:
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
if rank == 0 and os.environ.get("OUT"):
    torch.save(state, os.environ["OUT"])
# gloo objects freed while the interpreter is whole (pytorch/pytorch#179291: freed at exit, they abort now and then)
del model, net, optimizer, loss, state
gc.collect()
dist.destroy_process_group()
