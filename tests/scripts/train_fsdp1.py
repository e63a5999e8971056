"""FSDP1 (FullyShardedDataParallel around each layer and the root) on gloo ranks: a small MLP, trained; unchanged
for dpprof.

Run under torchrun. Environment: FSDP_STEPS (default 4), FSDP_RESHARD (1: FULL_SHARD, resharding after forward, the
default; 0: SHARD_GRAD_OP, keeping the gathered parameters until backward; none: NO_SHARD, every rank holding every
parameter and all-reducing the gradients, as DDP does), FSDP_OUT (a path: rank 0 saves the trained
full state dict there), FSDP_CHECKPOINT (1: the root's forward runs each layer under torch.utils.checkpoint, so
backward calls the layers' FSDP forward again to recompute them).
"""
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, ShardingStrategy, StateDictType
from torch.utils.checkpoint import checkpoint


class Checkpointed(torch.nn.Sequential):
    """A Sequential whose FSDP layers (all but the last module) run under activation checkpointing in training."""

    def forward(self, x):
        for i, layer in enumerate(self):
            x = checkpoint(layer, x, use_reentrant=False) if self.training and i < len(self) - 1 else layer(x)
        return x


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
strategy = {"1": ShardingStrategy.FULL_SHARD, "0": ShardingStrategy.SHARD_GRAD_OP,
            "none": ShardingStrategy.NO_SHARD}[os.environ.get("FSDP_RESHARD", "1")]
cpu = torch.device("cpu")
layers = [FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(64 if i else 20, 64), torch.nn.ReLU()),
                                   device_id=cpu, sharding_strategy=strategy) for i in range(3)]
root = Checkpointed if os.environ.get("FSDP_CHECKPOINT") == "1" else torch.nn.Sequential
model = FullyShardedDataParallel(root(*layers, torch.nn.Linear(64, 7)), device_id=cpu,
                                 sharding_strategy=strategy)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1 + rank)
for _ in range(int(os.environ.get("FSDP_STEPS", "4"))):
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 7, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                              FullStateDictConfig(rank0_only=True)):
    state = model.state_dict()
if rank == 0 and os.environ.get("FSDP_OUT"):
    torch.save(state, os.environ["FSDP_OUT"])
# The gloo objects these globals hold (DDP's reducer, FSDP's state) abort the process now and then when the
# interpreter frees them at its exit ("terminate called without an active exception"; pytorch/pytorch#179291):
# as in train_ddp.py and train_fsdp.py. Freed here, while the interpreter is whole: every global that holds an FSDP
# module (the layers too), as the FSDP states hold the process group.
del model, layers, opt, loss, state
gc.collect()
dist.destroy_process_group()
