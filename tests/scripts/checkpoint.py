"""A script that looks at what it built and saves and reloads checkpoints, the whole module and its
state_dict. Usage: checkpoint.py OUT_PREFIX"""
import sys

import torch
from torch import nn
from torch.nn import DataParallel
from torch.nn.parallel import DataParallel as ParallelDataParallel
from torch.nn.parallel.data_parallel import DataParallel as ModuleDataParallel

prefix = sys.argv[1]
torch.manual_seed(0)
net = nn.Linear(4, 2)
model = DataParallel(net)
print("type", type(model).__name__, type(model).__module__, type(model).__qualname__)
print("isinstance", isinstance(model, nn.DataParallel), isinstance(model, ParallelDataParallel),
      isinstance(model, ModuleDataParallel), isinstance(model, nn.Module))
print("is torch's name", type(model) is nn.DataParallel, nn.DataParallel is ParallelDataParallel)
print("keys", sorted(model.state_dict()))
print("repr", repr(model).splitlines()[0])
out = model(torch.ones(6, 4))
print("output", torch.allclose(out, net(torch.ones(6, 4))))

torch.save(model, prefix + ".whole.pt")
torch.save(model.state_dict(), prefix + ".state.pt")
loaded = torch.load(prefix + ".whole.pt", weights_only=False)
print("loaded", type(loaded).__name__, isinstance(loaded, nn.DataParallel), torch.equal(loaded.module.weight, net.weight))
fresh = DataParallel(nn.Linear(4, 2))
fresh.load_state_dict(torch.load(prefix + ".state.pt"))
print("reloaded", torch.equal(fresh.module.weight, net.weight), torch.equal(fresh.module.bias, net.bias))
